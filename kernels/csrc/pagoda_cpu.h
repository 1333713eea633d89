// What the pagoda_cpu extension's source files share: bf16 as raw bits with torch's conversions,
// and what one file calls in another (decoder_layers in cpu_ops.cpp runs the attention kernels of
// paged_attention_cpu.cpp): the ops' checked entry points, as registered
// (torch.ops.pagoda_cpu.paged_{decode,prefill}_attention).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagoda {

// A bf16 element (its raw bits), as the kernels read and write torch's at::BFloat16 storage.
struct bf16_t { uint16_t x; };

// One-byte K/V cache elements (raw codes). torch.float8_e5m2: sign, 5 exponent bits, 2 mantissa bits
// (the top byte of a float16); torch.float8_e4m3fn: sign, 4 exponent bits, 3 mantissa bits, no
// infinities (vLLM's "fp8": finer steps, values up to 448). The cache writers store codes of the
// rows (cpu_ops.cpp, f8_row); the attention kernels read them (paged_attention_cpu.cpp).
struct f8e5m2_t { uint8_t x; };
struct f8e4m3_t { uint8_t x; };
// An int8 cache (torch.int8): each (token, kv head) row is head_dim codes followed by its float32
// scale (kRowScaleBytes; the cache's last dim is head_dim + 4), the row's values codes x scale, the
// scale its largest magnitude / 127 (cpu_ops.cpp, i8_row).
struct i8s_t { int8_t x; };
constexpr int kRowScaleBytes = 4;
// Which codes a cache element holds, if any (the kernels' F8 template parameter; kI8: i8s_t).
constexpr int kNoF8 = 0, kE5M2 = 1, kE4M3 = 2, kI8 = 3;
template <typename C>
constexpr int f8_kind() {
  return std::is_same_v<C, f8e5m2_t> ? kE5M2
         : std::is_same_v<C, f8e4m3_t> ? kE4M3
         : std::is_same_v<C, i8s_t>    ? kI8
                                       : kNoF8;
}
// Float8 codes (read as words of their values times a power of two), not int8 ones.
constexpr bool f8_codes(int kind) { return kind == kE5M2 || kind == kE4M3; }
// Elements between a cache's consecutive kv-head rows: dim, and an int8 cache's scale after each.
template <typename C>
constexpr int64_t cache_head_stride(int64_t dim) {
  return dim + (f8_kind<C>() == kI8 ? kRowScaleBytes : 0);
}
// A row's scale, stored after its head_dim codes.
inline float row_scale(const void* row, int64_t head_dim) {
  float s;
  std::memcpy(&s, static_cast<const char*>(row) + head_dim, sizeof s);
  return s;
}

// The one-byte caches' dtypes.
inline bool one_byte_dtype(at::ScalarType t) { return t == at::kFloat8_e5m2 || t == at::kFloat8_e4m3fn; }

// Calls f with a null pointer to a one-byte cache's element type (f8e5m2_t or f8e4m3_t).
template <typename F>
void with_f8_element(at::ScalarType cache, F&& f) {
  if (cache == at::kFloat8_e5m2)
    f(static_cast<f8e5m2_t*>(nullptr));
  else
    f(static_cast<f8e4m3_t*>(nullptr));
}
// Calls f with a null pointer to a coded cache's element: i8s_t for an int8 cache (torch.int8),
// else the one-byte code type (with_f8_element).
template <typename F>
void with_code_element(at::ScalarType cache, F&& f) {
  if (cache == at::kChar)
    f(static_cast<i8s_t*>(nullptr));
  else
    with_f8_element(cache, f);
}
// Whether the caches hold codes (one-byte or int8) rather than the queries' dtype.
inline bool coded_dtype(at::ScalarType t) { return one_byte_dtype(t) || t == at::kChar; }

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
