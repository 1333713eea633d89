// What the pagoda_cpu extension's source files share: bf16 as raw bits with torch's conversions,
// and what one file calls in another (decoder_layers in cpu_ops.cpp runs the attention kernels of
// paged_attention_cpu.cpp): the ops' checked entry points, as registered
// (torch.ops.pagoda_cpu.paged_{decode,prefill}_attention).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagoda {

// A bf16 element (its raw bits), as the kernels read and write torch's at::BFloat16 storage.
struct bf16_t { uint16_t x; };

inline float bf16_to_float(bf16_t v) {
  const uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as torch's float -> bfloat16 (a NaN becomes 0x7FC0).
inline bf16_t float_to_bf16(float f) {
  if (std::isnan(f)) return {0x7FC0};
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return {static_cast<uint16_t>(u >> 16)};
}

void decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out,
                      int64_t num_threads);

void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       double scale, at::Tensor& out, int64_t num_threads);

}  // namespace pagoda
