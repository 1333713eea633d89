// What one source file of the pagoda_cpu extension calls in another (decoder_layers in
// cpu_ops.cpp runs the attention kernels of paged_attention_cpu.cpp): the ops' checked entry
// points, as registered (torch.ops.pagoda_cpu.paged_{decode,prefill}_attention).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace pagoda {

void decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out,
                      int64_t num_threads);

void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       double scale, at::Tensor& out, int64_t num_threads);

}  // namespace pagoda
