// Fused elementwise ops of the Llama layer for the CPU: residual add + RMSNorm, rotary embedding,
// and the MLP's silu(gate) * up. Each replaces a chain of 2-10 torch ops (each a pass over memory
// and, above torch's grain size, an OpenMP parallel region) with one pass over rows; RMSNorm,
// rotary and silu_and_mul are written with AVX-512 intrinsics where the compiler targets it (gcc
// did not vectorise the scalar RMSNorm loops: 2048 x 576 bf16 rows took ~1.7 ms in an engine step),
// and bf16 silu is a table of torch's result for each of the 65536 inputs.
//
// Numerics follow the torch ops they replace (transformers' LlamaRMSNorm and apply_rotary_pos_emb)
// operation by operation: float32 statistics, and in a 16-bit model dtype a rounding to that
// dtype after every op that torch would round after. The file is built with -ffp-contract=off so
// the compiler never fuses a multiply and an add that torch performs (and rounds) separately.
// The only difference from torch can be the last bit of the RMSNorm mean (see rms_norm_impl).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/empty.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include "pagoda_cpu.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cpuid.h>
#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#endif

#include <omp.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <thread>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using pagoda::bf16_t;

inline float load(float v) { return v; }
inline float load(bf16_t v) { return pagoda::bf16_to_float(v); }
inline void store(float f, float* dst) { *dst = f; }
inline void store(float f, bf16_t* dst) { *dst = pagoda::float_to_bf16(f); }
// The value torch holds after an op whose result it stores in T.
inline float round_to(float f, float*) { return f; }
inline float round_to(float f, bf16_t*) {
  bf16_t b;
  store(f, &b);
  return load(b);
}

int threads_for(int64_t elements) {
  // One thread below ~64K elements: a parallel region costs more than it saves there.
  return elements < (1 << 16) ? 1 : omp_get_max_threads();
}

// v rounded to T and stored in O: T itself, or float32 holding T's value (exactly widened: the
// input of the float32 GEMM kernel, which would otherwise widen it in a pass of its own).
template <typename T, typename O>
inline void store_in(float v, O* dst) {
  if constexpr (std::is_same_v<T, O>)
    store(v, dst);
  else
    store(round_to(v, static_cast<T*>(nullptr)), dst);
}

// residual (if given) += x, rounded to T; out = weight * T(float(h) * rsqrt(mean(float(h)^2) + eps))
// with h the (updated) residual or x. x, residual, out: [T, H] with row strides; weight [H].
// The sum of squares is accumulated in double and rounded once: the correctly rounded float32
// sum, which torch's cascade summation also reaches in all but rare cases.
template <typename T>
inline double rms_row_scalar(const T* xr, T* hr, int64_t i0, int64_t hidden) {
  double sumsq = 0.0;
  for (int64_t i = i0; i < hidden; ++i) {
    float h = hr ? round_to(load(xr[i]) + load(hr[i]), static_cast<T*>(nullptr)) : load(xr[i]);
    if (hr) store(h, &hr[i]);
    sumsq += static_cast<double>(h * h);
  }
  return sumsq;
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// Round to the storage type (nearest even; NaN stays NaN) and return the value it holds.
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m256i to_bf16_bits_emulated(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  r = _mm512_srli_epi32(r, 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}
// vcvtneps2bf16 rounds to nearest even as torch does, in 2 uops instead of 9, but flushes denormal
// inputs to zero and keeps a NaN's sign and payload (torch writes 0x7FC0): vectors holding either
// take the emulated conversion.
inline __m256i to_bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
  if (!_mm512_fpclass_ps_mask(v, 0x01 | 0x80 | 0x20))  // quiet NaN | signalling NaN | denormal
    return (__m256i)_mm512_cvtneps_pbh(v);
#endif
  return to_bf16_bits_emulated(v);
}
inline __m512 round16(__m512 v, const bf16_t*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
// *p = T(h + *p); returns the value stored (one conversion for the store and the value).
inline __m512 add_store16(__m512 h, float* p) {
  const __m512 s = _mm512_add_ps(h, _mm512_loadu_ps(p));
  _mm512_storeu_ps(p, s);
  return s;
}
inline __m512 add_store16(__m512 h, bf16_t* p) {
  const __m256i bits = to_bf16_bits(_mm512_add_ps(h, load16(p)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(bf16_t* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16_bits(v)); }
#define PAGODA_EW_AVX512 1
#else
#define PAGODA_EW_AVX512 0
#endif

// The same ops 8 lanes wide where the compiler targets AVX2 but not AVX-512 (Zen 1-3, older Intel).
#if !PAGODA_EW_AVX512 && defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 round8(__m256 v, const float*) { return v; }
// Each lane rounded to bf16 (nearest even, NaN -> 0x7FC0, as torch), the bits in its low 16.
inline __m256i bf16_bits_lanes(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m128i to_bf16_bits(__m256 v) {
  const __m256i r = bf16_bits_lanes(v);
  // 32 -> 16 bits (values fit in 16 unsigned bits): pack within lanes, then fix the lane order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  return _mm256_castsi256_si128(packed);
}
inline __m256 round8(__m256 v, const bf16_t*) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits_lanes(v), 16)); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(bf16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), to_bf16_bits(v)); }
#define PAGODA_EW_AVX2 1
#else
#define PAGODA_EW_AVX2 0
#endif

// The elementwise ops' float vector, one implementation a width (AVX-512's 16 lanes, AVX2's 8), so
// that rms_norm_impl, RowRotator, silu_mul_row and the GEMM epilogues are written once. Each width
// keeps its own lane order and its own sums: its results are what they were.
#if PAGODA_EW_AVX512
struct VecWidth {
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  template <typename T>
  static V load(const T* p) { return load16(p); }
  template <typename T>
  static void store(T* p, V v) { store16(p, v); }
  // v rounded to T (its value as a float)
  template <typename T>
  static V round(V v) { return round16(v, static_cast<T*>(nullptr)); }
  // *p = T(h + *p); returns the value stored
  template <typename T>
  static V add_store(V h, T* p) { return add_store16(h, p); }
  static V set1(float f) { return _mm512_set1_ps(f); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V neg(V a) {  // exact
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(INT32_MIN)));
  }
  // The lanes' bf16 bits (of v rounded to bf16) in the low halves of 32-bit lanes: a table index.
  using Idx = __m512i;
  static Idx bf16_index(V v) { return _mm512_cvtepu16_epi32(to_bf16_bits(v)); }
  static Idx bf16_index(const bf16_t* p) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static Idx iota(int32_t b) {
    return _mm512_add_epi32(_mm512_set1_epi32(b), _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  }
  static V bf16_value(Idx bits) { return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16)); }
  // The 16-bit entries of table at the indices, as the bf16 values they hold.
  static V gather_bf16(Idx idx, const uint16_t* table) { return bf16_value(_mm512_i32gather_epi32(idx, table, 2)); }
  // Sums of h * h (each float product exactly widened) in double, 2 x 8 lanes.
  struct SumSq {
    __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
    void add(V h) {
      const V hsq = _mm512_mul_ps(h, h);  // the float product the scalar loop widens
      a0 = _mm512_add_pd(a0, _mm512_cvtps_pd(_mm512_castps512_ps256(hsq)));
      a1 = _mm512_add_pd(a1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(hsq), 1))));
    }
    double sum() const { return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1)); }
  };
};
#elif PAGODA_EW_AVX2
struct VecWidth {
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  template <typename T>
  static V load(const T* p) { return load8(p); }
  template <typename T>
  static void store(T* p, V v) { store8(p, v); }
  template <typename T>
  static V round(V v) { return round8(v, static_cast<T*>(nullptr)); }
  template <typename T>
  static V add_store(V h, T* p) {
    const V s = round8(_mm256_add_ps(h, load8(p)), static_cast<T*>(nullptr));
    store8(p, s);
    return s;
  }
  static V set1(float f) { return _mm256_set1_ps(f); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V neg(V a) { return _mm256_xor_ps(a, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))); }
  using Idx = __m256i;
  static Idx bf16_index(V v) { return bf16_bits_lanes(v); }
  static Idx bf16_index(const bf16_t* p) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static Idx iota(int32_t b) { return _mm256_add_epi32(_mm256_set1_epi32(b), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)); }
  static V bf16_value(Idx bits) { return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16)); }
  static V gather_bf16(Idx idx, const uint16_t* table) {
    return bf16_value(_mm256_i32gather_epi32(reinterpret_cast<const int*>(table), idx, 2));
  }
  // 2 x 4 lanes
  struct SumSq {
    __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
    void add(V h) {
      const V hsq = _mm256_mul_ps(h, h);
      a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(hsq)));
      a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(hsq, 1)));
    }
    double sum() const {
      const __m256d a = _mm256_add_pd(a0, a1);
      const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(a), _mm256_extractf128_pd(a, 1));
      return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
    }
  };
};
#endif
#define PAGODA_EW_VEC (PAGODA_EW_AVX512 || PAGODA_EW_AVX2)
#if PAGODA_EW_VEC
// The width's ops, and what is built from them the same way at either width.
struct Vec : VecWidth {
  // v rounded to T and stored in O: T itself, or float32 holding T's value (store_in's vector form)
  template <typename T, typename O>
  static void store_in(O* p, V v) {
    if constexpr (std::is_same_v<T, O>)
      store(p, v);
    else
      store(p, round<T>(v));
  }
};
#endif

template <typename T, typename O = T>
void rms_norm_impl(const T* x, int64_t x_stride, T* residual, int64_t res_stride, const T* weight, O* out,
                   int64_t out_stride, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * hidden))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    O* outr = out + r * out_stride;
    T* hr = residual ? residual + r * res_stride : nullptr;
    int64_t i = 0;
    double sumsq = 0.0;
#if PAGODA_EW_VEC
    // h*h is exact in double, like the float product widened in the scalar loop: the same sum.
    Vec::SumSq acc;
    for (; i + Vec::kLanes <= hidden; i += Vec::kLanes) {
      Vec::V h = Vec::load(xr + i);
      if (hr) h = Vec::add_store(h, hr + i);
      acc.add(h);
    }
    sumsq = acc.sum();
#endif
    sumsq += rms_row_scalar(xr, hr, i, hidden);
    const T* src = hr ? hr : xr;
    const float inv = 1.f / std::sqrt(static_cast<float>(sumsq) / static_cast<float>(hidden) + eps);
    i = 0;
#if PAGODA_EW_VEC
    const Vec::V vinv = Vec::set1(inv);
    for (; i + Vec::kLanes <= hidden; i += Vec::kLanes) {
      const Vec::V n = Vec::round<T>(Vec::mul(Vec::load(src + i), vinv));
      Vec::store_in<T>(outr + i, Vec::mul(Vec::load(weight + i), n));
    }
#endif
    for (; i < hidden; ++i) {
      float n = round_to(load(src[i]) * inv, static_cast<T*>(nullptr));
      store_in<T>(load(weight[i]) * n, &outr[i]);
    }
  }
}

// out = x * cos + rotate_half(x) * sin per head, cos/sin rows picked by position (float32 tables
// [P, D], rounded to T first as torch's .to(dtype) does).
//
// RowRotator: one token's cos / sin row, rounded once, applied to any number of head runs of that
// token (x: `heads` rows of `dim` contiguous elements; out likewise).
template <typename T>
struct RowRotator {
  int64_t half;
#if PAGODA_EW_VEC
  // The same arithmetic a vector at a time: 2.1x the auto-vectorized loop below on the q of a
  // 2048-token SmolLM2 step (Zen 4, 16 lanes); the QKV GEMM's rotary epilogue ~2x on Zen 3 (8).
  bool vec;
  int64_t hv;
  Vec::V cr[256 / Vec::kLanes], sr[256 / Vec::kLanes];
#endif
  const float* c;
  const float* s;

  RowRotator(const float* cos_row, const float* sin_row, int64_t dim) : half(dim / 2), c(cos_row), s(sin_row) {
#if PAGODA_EW_VEC
    vec = half % Vec::kLanes == 0 && dim <= 256;
    hv = half / Vec::kLanes;
    if (vec)
      for (int64_t v = 0; v < 2 * hv; ++v) {
        cr[v] = Vec::round<T>(Vec::load(c + Vec::kLanes * v));
        sr[v] = Vec::round<T>(Vec::load(s + Vec::kLanes * v));
      }
#endif
  }

  void apply(const T* x, T* out, int64_t heads) const {
    const int64_t dim = 2 * half;
#if PAGODA_EW_VEC
    if (vec) {
      constexpr int64_t w = Vec::kLanes;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xh = x + h * dim;
        T* oh = out + h * dim;
        for (int64_t v = 0; v < hv; ++v) {
          const Vec::V x1 = Vec::load(xh + w * v), x2 = Vec::load(xh + half + w * v);
          const Vec::V a1 = Vec::round<T>(Vec::mul(x1, cr[v])), b1 = Vec::round<T>(Vec::mul(Vec::neg(x2), sr[v]));
          const Vec::V a2 = Vec::round<T>(Vec::mul(x2, cr[hv + v])), b2 = Vec::round<T>(Vec::mul(x1, sr[hv + v]));
          Vec::store(oh + w * v, Vec::add(a1, b1));
          Vec::store(oh + half + w * v, Vec::add(a2, b2));
        }
      }
      return;
    }
#endif
    for (int64_t h = 0; h < heads; ++h) {
      const T* xh = x + h * dim;
      T* oh = out + h * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = load(xh[i]), x2 = load(xh[i + half]);
        const float c1 = round_to(c[i], static_cast<T*>(nullptr)), c2 = round_to(c[i + half], static_cast<T*>(nullptr));
        const float s1 = round_to(s[i], static_cast<T*>(nullptr)), s2 = round_to(s[i + half], static_cast<T*>(nullptr));
        const float a1 = round_to(x1 * c1, static_cast<T*>(nullptr)), b1 = round_to(-x2 * s1, static_cast<T*>(nullptr));
        const float a2 = round_to(x2 * c2, static_cast<T*>(nullptr)), b2 = round_to(x1 * s2, static_cast<T*>(nullptr));
        store(a1 + b1, &oh[i]);
        store(a2 + b2, &oh[i + half]);
      }
    }
  }
};

// x: [T, heads, D] (head rows contiguous, token stride free); out: [T, heads, D] contiguous.
template <typename T>
void rotary_impl(const T* x, int64_t x_stride, T* out, const int64_t* positions, const float* cos_table,
                 const float* sin_table, int64_t table_stride, int64_t rows, int64_t heads, int64_t dim) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * heads * dim))
  for (int64_t r = 0; r < rows; ++r) {
    const RowRotator<T> rot(cos_table + positions[r] * table_stride, sin_table + positions[r] * table_stride, dim);
    rot.apply(x + r * x_stride, out + r * heads * dim, heads);
  }
}

// ---- a one-byte K/V cache (float8_e5m2 or float8_e4m3fn codes; the decode kernel reads them) ------
// Codes of n bf16 or float32 values as torch's conversion gives them: for e5m2, c10's
// fp8e5m2_from_fp32_value (nearest even, subnormals kept, overflow to infinity), so the writers store
// exactly what key.to(torch.float8_e5m2) stores; for e4m3, c10's fp8e4m3fn_from_fp32_value on the
// values clamped to [-448, 448] (nearest even, subnormals kept, saturating where torch's conversion
// alone gives NaN, as vLLM's fp8 writers do): key.clamp(-448, 448).to(torch.float8_e4m3fn).
// The steps, lane by lane on |x|'s float32 bits f: a normal result rounds the mantissa to M bits
// (nearest even) and rebiases the exponent; below the smallest normal, a float add rounds to a
// multiple of the smallest subnormal; at or above `big`, the largest code (infinity for e5m2, 448
// for e4m3), NaN a NaN.
template <int F8>
struct F8Steps;
template <>
struct F8Steps<pagoda::kE5M2> {
  static constexpr int kShift = 21;                           // 23 - mantissa bits
  static constexpr uint32_t kRebias = (uint32_t(15 - 127) << 23) + 0xFFFFF;
  static constexpr uint32_t kMinNormal = 113u << 23;          // 2^-14
  static constexpr uint32_t kDenorm = 134u << 23;             // 2^7: its float ulp is 2^-16
  static constexpr uint32_t kBig = 143u << 23;                // 2^16
  static constexpr uint32_t kBigCode = 0x7C;                  // infinity
  static uint8_t scalar(float v) { return c10::Float8_e5m2(v).x; }
};
template <>
struct F8Steps<pagoda::kE4M3> {
  static constexpr int kShift = 20;
  static constexpr uint32_t kRebias = (uint32_t(7 - 127) << 23) + 0x7FFFF;
  static constexpr uint32_t kMinNormal = 121u << 23;          // 2^-6
  static constexpr uint32_t kDenorm = 141u << 23;             // 2^14: its float ulp is 2^-9
  static constexpr uint32_t kBig = 0x43E00000u;               // 448
  static constexpr uint32_t kBigCode = 0x7E;                  // 448
  static uint8_t scalar(float v) { return c10::Float8_e4m3fn(std::isnan(v) ? v : std::clamp(v, -448.f, 448.f)).x; }
};

template <int F8, typename S>
inline void f8_row(const S* src, uint8_t* dst, int64_t n) {
  using K = F8Steps<F8>;
  int64_t i = 0;
#if PAGODA_EW_AVX512
  if constexpr (std::is_same_v<S, bf16_t>) {  // (float32 rows: the AVX2 steps, or c10's)
  const auto c = [](uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); };
  for (; i + 16 <= n; i += 16) {
    const __m512i bits =
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16);
    const __m512i sign = _mm512_and_si512(bits, c(0x80000000u));
    const __m512i f = _mm512_xor_si512(bits, sign);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(f, K::kShift), c(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(f, c(K::kRebias)), odd), K::kShift);
    const __m512i den = _mm512_sub_epi32(
        _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(f), _mm512_castsi512_ps(c(K::kDenorm)))), c(K::kDenorm));
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(f, c(K::kMinNormal)), den);
    const __m512i big = _mm512_mask_blend_epi32(_mm512_cmpgt_epu32_mask(f, c(0x7F800000u)), c(K::kBigCode), c(0x7F));
    r = _mm512_mask_mov_epi32(r, _mm512_cmpge_epu32_mask(f, c(K::kBig)), big);
    r = _mm512_or_si512(_mm512_and_si512(r, c(0xFF)), _mm512_srli_epi32(sign, 24));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(r));
  }
  }
#endif
#if PAGODA_EW_AVX2 || PAGODA_EW_AVX512
  // The same steps, 8 lanes (signed compares: the sign bit is cleared).
  const auto c = [](uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); };
  const __m256i low_bytes = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                             0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (; i + 8 <= n; i += 8) {
    __m256i bits;
    if constexpr (std::is_same_v<S, bf16_t>)
      bits = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))), 16);
    else
      bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m256i sign = _mm256_and_si256(bits, c(0x80000000u));
    const __m256i f = _mm256_xor_si256(bits, sign);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(f, K::kShift), c(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(f, c(K::kRebias)), odd), K::kShift);
    const __m256i den = _mm256_sub_epi32(
        _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(f), _mm256_castsi256_ps(c(K::kDenorm)))), c(K::kDenorm));
    r = _mm256_blendv_epi8(r, den, _mm256_cmpgt_epi32(c(K::kMinNormal), f));
    const __m256i big = _mm256_blendv_epi8(c(K::kBigCode), c(0x7F), _mm256_cmpgt_epi32(f, c(0x7F800000u)));
    r = _mm256_blendv_epi8(r, big, _mm256_cmpgt_epi32(f, c(K::kBig - 1)));
    r = _mm256_or_si256(_mm256_and_si256(r, c(0xFF)), _mm256_srli_epi32(sign, 24));
    const __m256i b = _mm256_shuffle_epi8(r, low_bytes);  // each 128-bit lane's 4 codes in its low dword
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i),
                     _mm_unpacklo_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
  }
#endif
  for (; i < n; ++i) dst[i] = K::scalar(load(src[i]));
}

// One (token, kv head) row of dim values into an int8 cache's row (pagoda_cpu.h, i8s_t): dim codes
// round(x * (127 / amax)) (nearest even; amax the row's largest magnitude), then the float32 scale
// amax / 127; a row of zeros (or a NaN amax) gets scale 1 and codes round(x), NaN values code 0.
// kernels/attention.py's quantize_int8_rows gives the same bytes.
template <typename S>
inline void i8_row(const S* src, int8_t* dst, int64_t dim) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < dim; ++i) {
    const float a = std::fabs(load(src[i]));
    nan |= a != a;
    amax = std::max(amax, a);
  }
  const bool pos = !nan && amax > 0.f;
  const float scale = pos ? amax / 127.f : 1.f, inv = pos ? 127.f / amax : 1.f;
  for (int64_t i = 0; i < dim; ++i) {
    const float v = load(src[i]) * inv;
    dst[i] = static_cast<int8_t>(v != v ? 0.f : std::nearbyint(std::clamp(v, -127.f, 127.f)));
  }
  std::memcpy(dst + dim, &scale, sizeof scale);
}

// A K/V row (kv_heads x dim, T) into its cache slot: copied, or as one-byte codes (C = f8e5m2_t or
// f8e4m3_t).
template <typename T, typename C>
inline void cache_row(const T* row, C* slot, int64_t n) {
  if constexpr (std::is_same_v<C, T>) {
    std::memcpy(slot, row, n * sizeof(T));
  } else {
    static_assert(pagoda::f8_kind<C>() != pagoda::kNoF8, "a cache holds the rows' dtype or one-byte codes");
    f8_row<pagoda::f8_kind<C>()>(row, reinterpret_cast<uint8_t*>(slot), n);
  }
}

// One kv head's row of dim values into a cache of C at (slot, head h): copied, as one-byte codes,
// or as int8 codes and their scale.
template <typename T, typename C>
inline void cache_head(const T* row, C* cache, int64_t slot, int64_t h, int64_t kv_heads, int64_t dim) {
  C* at = cache + (slot * kv_heads + h) * pagoda::cache_head_stride<C>(dim);
  if constexpr (pagoda::f8_kind<C>() == pagoda::kI8)
    i8_row(row, reinterpret_cast<int8_t*>(at), dim);
  else
    cache_row(row, at, dim);
}

// A token's row (kv_heads x dim) into its slot of a cache of C.
template <typename T, typename C>
inline void cache_token(const T* row, C* cache, int64_t slot, int64_t kv_heads, int64_t dim) {
  if constexpr (pagoda::f8_kind<C>() == pagoda::kI8) {
    for (int64_t h = 0; h < kv_heads; ++h) cache_head(row + h * dim, cache, slot, h, kv_heads, dim);
  } else {
    cache_row(row, cache + slot * kv_heads * dim, kv_heads * dim);
  }
}

// Whether a cache of this dtype takes rows of T's: the same dtype, or bf16 or float32 rows in a
// one-byte or int8 cache.
inline bool cache_takes(at::ScalarType cache, at::ScalarType rows) {
  return cache == rows || (pagoda::coded_dtype(cache) && (rows == at::kBFloat16 || rows == at::kFloat));
}

// A cache's head_dim: its last dim, less an int8 cache's scale bytes.
inline int64_t cache_head_dim(const at::Tensor& cache) {
  return cache.size(-1) - (cache.scalar_type() == at::kChar ? pagoda::kRowScaleBytes : 0);
}

// Calls f with null pointers of the row type E (at::kBFloat16 rows: bf16_t) and of the cache's
// element: E's own, a one-byte cache's code type, or i8s_t for an int8 cache.
template <typename E, typename F>
void with_cache_element(at::ScalarType cache, F&& f) {
  if (pagoda::coded_dtype(cache))
    pagoda::with_code_element(cache, [&](auto* c) { f(static_cast<E*>(nullptr), c); });
  else
    f(static_cast<E*>(nullptr), static_cast<E*>(nullptr));
}

// The fused QKV projection's output -> rotary q (q_out), and for the rows with a cache slot the
// rotary k and the v written straight into their slots of the caches: rotary_embedding of q and of k
// and reshape_and_cache in one pass (no k temporary, one parallel region instead of three). qkv
// [T, (H + 2 kvh) D] (row stride free); rows r < Tr = len(slot_mapping) get cached, rows past Tr
// (GEMM padding) only their q.
// C: the caches' element, T or a one-byte code type (codes of the rows: rotary(k) through a row buffer).
template <typename T, typename C = T>
void rotary_qkv_cache_impl(const T* qkv, int64_t qkv_stride, T* q_out, C* key_cache, C* value_cache,
                           const int64_t* slots, int64_t cached_rows, const int64_t* positions, const float* cos_table,
                           const float* sin_table, int64_t table_stride, int64_t rows, int64_t heads, int64_t kv_heads,
                           int64_t dim) {
  const int64_t kv_row = kv_heads * dim;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * (heads + 2 * kv_heads) * dim))
  for (int64_t r = 0; r < rows; ++r) {
    const RowRotator<T> rot(cos_table + positions[r] * table_stride, sin_table + positions[r] * table_stride, dim);
    const T* x = qkv + r * qkv_stride;
    rot.apply(x, q_out + r * heads * dim, heads);
    if (r < cached_rows) {
      if constexpr (std::is_same_v<C, T>) {
        rot.apply(x + heads * dim, key_cache + slots[r] * kv_row, kv_heads);
      } else {
        thread_local std::vector<T> k;
        k.resize(kv_row);
        rot.apply(x + heads * dim, k.data(), kv_heads);
        cache_token(k.data(), key_cache, slots[r], kv_heads, dim);
      }
      cache_token(x + (heads + kv_heads) * dim, value_cache, slots[r], kv_heads, dim);
    }
  }
}

void check_rows(const at::Tensor& t, const char* name, int64_t rows, int64_t hidden) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == hidden && t.stride(1) == 1, name,
              " must be [", rows, ", ", hidden, "] with contiguous rows, got ", t.sizes(), " strides ", t.strides());
}

// out = RMSNorm(residual += x) when residual is given (updated in place), else RMSNorm(x). For bf16
// x, out may be float32: it then holds the bf16 values exactly (what the float32 GEMM kernel takes).
void rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& residual, const at::Tensor& weight, double eps,
              at::Tensor& out) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  check_rows(x, "x", rows, hidden);
  check_rows(out, "out", rows, hidden);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(), "weight must be [", hidden, "]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() &&
                  (out.scalar_type() == x.scalar_type() ||
                   (x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kFloat)),
              "x and weight must share a dtype, and out have it (or be float32 for bf16 x)");
  if (residual) {
    check_rows(*residual, "residual", rows, hidden);
    TORCH_CHECK(residual->scalar_type() == x.scalar_type(), "residual must have x's dtype");
  }
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case at::kFloat:
      rms_norm_impl<float>(x.data_ptr<float>(), x.stride(0), residual ? residual->data_ptr<float>() : nullptr,
                           residual ? residual->stride(0) : 0, weight.data_ptr<float>(), out.data_ptr<float>(),
                           out.stride(0), rows, hidden, e);
      break;
    case at::kBFloat16: {
      const auto* xp = static_cast<const bf16_t*>(x.data_ptr());
      auto* rp = residual ? static_cast<bf16_t*>(residual->data_ptr()) : nullptr;
      const int64_t rs = residual ? residual->stride(0) : 0;
      const auto* wp = static_cast<const bf16_t*>(weight.data_ptr());
      if (out.scalar_type() == at::kFloat)
        rms_norm_impl<bf16_t, float>(xp, x.stride(0), rp, rs, wp, out.data_ptr<float>(), out.stride(0), rows, hidden, e);
      else
        rms_norm_impl<bf16_t>(xp, x.stride(0), rp, rs, wp, static_cast<bf16_t*>(out.data_ptr()), out.stride(0), rows,
                              hidden, e);
      break;
    }
    default:
      TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
}

// out [T, heads, D] contiguous = rotary(x [T, heads, D]) at positions [T] (int64).
void rotary_embedding(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_table,
                      const at::Tensor& sin_table, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "x must be [T, heads, D] with contiguous heads");
  const int64_t rows = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "out must be a contiguous tensor like x");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(), "positions must be int64 [T]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.dim() == 2 && cos_table.size(1) == dim && cos_table.stride(1) == 1 &&
                  sin_table.sizes() == cos_table.sizes() && sin_table.strides() == cos_table.strides(),
              "cos/sin tables must be float32 [positions, head_dim] alike");
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_table.size(0);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " outside the rotary table [0, ", max_pos, ")");
  switch (x.scalar_type()) {
    case at::kFloat:
      rotary_impl<float>(x.data_ptr<float>(), x.stride(0), out.data_ptr<float>(), pos, cos_table.data_ptr<float>(),
                         sin_table.data_ptr<float>(), cos_table.stride(0), rows, heads, dim);
      break;
    case at::kBFloat16:
      rotary_impl<bf16_t>(static_cast<const bf16_t*>(x.data_ptr()), x.stride(0), static_cast<bf16_t*>(out.data_ptr()),
                          pos, cos_table.data_ptr<float>(), sin_table.data_ptr<float>(), cos_table.stride(0), rows,
                          heads, dim);
      break;
    default:
      TORCH_CHECK(false, "rotary_embedding: unsupported dtype ", x.scalar_type());
  }
}

// qkv [T, (H + 2 kvh) D] (rows contiguous, row stride free) -> q_out [T, H, D] contiguous = rotary(q);
// rotary(k) and v into key_cache / value_cache [num_blocks, block_size, kvh, D] (contiguous) at
// slot_mapping [Tr] (int64, Tr <= T) for rows r < Tr. positions [T] int64.
void rotary_qkv_to_cache(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_table,
                         const at::Tensor& sin_table, at::Tensor& q_out, at::Tensor& key_cache, at::Tensor& value_cache,
                         const at::Tensor& slot_mapping) {
  TORCH_CHECK(q_out.dim() == 3 && q_out.is_contiguous(), "q_out must be a contiguous [T, H, D] tensor");
  const int64_t rows = q_out.size(0), heads = q_out.size(1), dim = q_out.size(2);
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && cache_head_dim(key_cache) == dim,
              "caches must be contiguous [num_blocks, block_size, kv_heads, ", dim, "] alike (", dim + 4,
              " for int8 caches: codes and a scale a row)");
  const int64_t kv_heads = key_cache.size(2), num_slots = key_cache.size(0) * key_cache.size(1);
  check_rows(qkv, "qkv", rows, (heads + 2 * kv_heads) * dim);
  TORCH_CHECK(qkv.scalar_type() == q_out.scalar_type() && cache_takes(key_cache.scalar_type(), qkv.scalar_type()) &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "qkv, q_out and the caches must share a dtype (or one-byte caches: float8_e5m2, float8_e4m3fn; or int8)");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == rows && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(), "positions must be int64 [", rows, "]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.dim() == 2 && cos_table.size(1) == dim && cos_table.stride(1) == 1 &&
                  sin_table.sizes() == cos_table.sizes() && sin_table.strides() == cos_table.strides(),
              "cos/sin tables must be float32 [positions, head_dim] alike");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) <= rows && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(), "slot_mapping must be int64 [Tr], Tr <= ", rows);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos_table.size(0);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < max_pos, "position ", pos[r], " outside the rotary table [0, ", max_pos, ")");
  const int64_t cached = slot_mapping.size(0);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < cached; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "slot ", slots[r], " outside the cache [0, ", num_slots, ")");
  TORCH_CHECK(qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16,
              "rotary_qkv_to_cache: unsupported dtype ", qkv.scalar_type());
  const auto run = [&](auto* e, auto* c) {
    using E = std::remove_pointer_t<decltype(e)>;
    using C = std::remove_pointer_t<decltype(c)>;
    rotary_qkv_cache_impl<E, C>(static_cast<const E*>(qkv.data_ptr()), qkv.stride(0), static_cast<E*>(q_out.data_ptr()),
                                static_cast<C*>(key_cache.data_ptr()), static_cast<C*>(value_cache.data_ptr()), slots,
                                cached, pos, cos_table.data_ptr<float>(), sin_table.data_ptr<float>(),
                                cos_table.stride(0), rows, heads, kv_heads, dim);
  };
  if (qkv.scalar_type() == at::kFloat)
    with_cache_element<float>(key_cache.scalar_type(), run);
  else
    with_cache_element<bf16_t>(key_cache.scalar_type(), run);
}

#if PAGODA_EW_AVX512
// torch's own vectorised exp (Sleef, exported by libtorch_cpu): F.silu's exact arithmetic.
extern "C" __m512 Sleef_expf16_u10(__m512);
// torch's silu in float32, x / (1 + exp(-x)) with Sleef's exp and a division: the exact reference.
inline __m512 silu_exact(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
#elif PAGODA_EW_AVX2
extern "C" __m256 Sleef_expf8_u10(__m256);  // what torch's AVX2 kernels call
// torch's AVX2 silu: the same arithmetic 8 lanes wide.
inline __m256 silu_exact(__m256 x) {
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}
#endif

#if PAGODA_EW_VEC
// bf16 silu by table: entry b holds the bits of torch's F.silu of the bf16 with bits b (computed
// as its vectorised kernel computes it on this CPU: silu_exact at this width), rounded to bf16,
// for all 65536 inputs (+ pad entries: the 32-bit gather reads 2 bytes past the last). A gather
// instead of the arithmetic: 1.5x the silu_and_mul of a 2048-token SmolLM2 step on Zen 4 against
// a Cody-Waite exp polynomial that recomputed lanes near a rounding boundary exactly (3.7 against
// 2.5 G elements/s; 16 scalar lookups per vector instead of the gather: 3.6); on Zen 3 (AVX2) the
// gate/up GEMM's epilogue 2.4x faster than Sleef's exp and a division (bench/RESULTS.md).
const uint16_t* silu_bf16_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 16);
    for (int32_t b = 0; b < 65536; b += Vec::kLanes)
      Vec::store(reinterpret_cast<bf16_t*>(t.data() + b), silu_exact(Vec::bf16_value(Vec::iota(b))));
    return t;
  }();
  return table.data();
}
#endif

// o[i] = T(silu(g[i])) * u[i], rounded to T, for i < n: F.silu(gate) * up with the same arithmetic
// as torch's kernels (float(x) / (1 + exp(-float(x))), rounded to T, then a rounded product).
template <typename T, typename O = T>
inline void silu_mul_row(const T* g, const T* u, O* o, int64_t n) {
  int64_t i = 0;
#if PAGODA_EW_VEC
  [[maybe_unused]] const uint16_t* table = std::is_same_v<T, bf16_t> ? silu_bf16_table() : nullptr;
  // torch's vectorised loop takes 2 x Vectorized<T>::size() elements a step (two vectors' bytes of
  // T) and leaves the rest to its scalar op: the same split gives every element torch's exp.
  constexpr int64_t w = Vec::kLanes, step = 2 * w * 4 / sizeof(T);
  for (; i + step <= n; i += step) {
    for (int64_t h = 0; h < step; h += w) {
      Vec::V s;
      if constexpr (std::is_same_v<T, bf16_t>) {
        s = Vec::gather_bf16(Vec::bf16_index(g + i + h), table);
      } else {
        s = silu_exact(Vec::load(g + i + h));
      }
      Vec::store_in<T>(o + i + h, Vec::mul(s, Vec::load(u + i + h)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float x = load(g[i]);
    const float s = round_to(x / (1.f + std::exp(-x)), static_cast<T*>(nullptr));
    store_in<T>(s * load(u[i]), &o[i]);
  }
}

// out = silu(gate) * up (silu_mul_row) with gate / up the two halves of each row of gate_up [T, 2I]
// (row stride free).
template <typename T>
void silu_and_mul_impl(const T* gate_up, int64_t in_stride, T* out, int64_t out_stride, int64_t rows, int64_t inter) {
#if PAGODA_EW_VEC
  if constexpr (std::is_same_v<T, bf16_t>) silu_bf16_table();  // built once, before the threads start
#endif
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * inter))
  for (int64_t r = 0; r < rows; ++r) {
    const T* g = gate_up + r * in_stride;
    silu_mul_row(g, g + inter, out + r * out_stride, inter);
  }
}

void silu_and_mul(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be [T, 2 * I] with contiguous rows");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  check_rows(out, "out", rows, inter);
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "out must have gate_up's dtype");
  switch (gate_up.scalar_type()) {
    case at::kFloat:
      silu_and_mul_impl<float>(gate_up.data_ptr<float>(), gate_up.stride(0), out.data_ptr<float>(), out.stride(0),
                               rows, inter);
      break;
    case at::kBFloat16:
      silu_and_mul_impl<bf16_t>(static_cast<const bf16_t*>(gate_up.data_ptr()), gate_up.stride(0),
                                static_cast<bf16_t*>(out.data_ptr()), out.stride(0), rows, inter);
      break;
    default:
      TORCH_CHECK(false, "silu_and_mul: unsupported dtype ", gate_up.scalar_type());
  }
}

// reshape_and_cache: key / value [T, kv_heads, D] (each token's heads contiguous, token stride free,
// e.g. views into the fused QKV output) -> their slots of key_cache / value_cache [num_blocks,
// block_size, kv_heads, D] (contiguous). One copy of each token's row, parallel over tokens; torch's
// index_copy_ moved ~6 GB/s here (257 us for a 2048-token step of SmolLM2, 30 times a step).
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache, at::Tensor& value_cache,
                       const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(), "caches must be contiguous [num_blocks, block_size, kv_heads, D] alike");
  // (An int8 cache's rows: D codes and a float32 scale, pagoda_cpu.h, i8s_t.)
  const int64_t kvh = key_cache.size(2), dim = cache_head_dim(key_cache), num_slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(dim > 0, "an int8 cache's last dim is head_dim + ", pagoda::kRowScaleBytes, ", got ", key_cache.size(3));
  const int64_t rows = key.size(0), row = kvh * dim;
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == rows && t->size(1) == kvh && t->size(2) == dim && t->stride(2) == 1 &&
                    t->stride(1) == dim, "key / value must be [T, ", kvh, ", ", dim, "] with contiguous heads, got ",
                t->sizes(), " strides ", t->strides());
    TORCH_CHECK(cache_takes(key_cache.scalar_type(), t->scalar_type()),
                "key / value must have the caches' dtype (or be bf16 or float32 for one-byte caches, and for int8 ones)");
  }
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "caches must share a dtype");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value must share a dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == rows && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(), "slot_mapping must be int64 [T]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "slot ", slots[r], " outside the cache [0, ", num_slots, ")");
  if (key_cache.scalar_type() != key.scalar_type()) {  // bf16 or float32 rows, one-byte or int8 codes
    const auto codes = [&](auto* e, auto* c) {
      using E = std::remove_pointer_t<decltype(e)>;
      using C = std::remove_pointer_t<decltype(c)>;
      const auto* k = static_cast<const E*>(key.data_ptr());
      const auto* v = static_cast<const E*>(value.data_ptr());
      auto* kc = static_cast<C*>(key_cache.data_ptr());
      auto* vc = static_cast<C*>(value_cache.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * row * 2))
      for (int64_t r = 0; r < rows; ++r) {
        cache_token(k + r * key.stride(0), kc, slots[r], kvh, dim);
        cache_token(v + r * value.stride(0), vc, slots[r], kvh, dim);
      }
    };
    if (key.scalar_type() == at::kFloat)
      with_cache_element<float>(key_cache.scalar_type(), codes);
    else
      with_cache_element<bf16_t>(key_cache.scalar_type(), codes);
    return;
  }
  const int64_t bytes = row * static_cast<int64_t>(key.element_size());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  const int64_t ks = key.stride(0) * key.element_size(), vs = value.stride(0) * value.element_size();
  char* kc = static_cast<char*>(key_cache.data_ptr());
  char* vc = static_cast<char*>(value_cache.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * row * 2))
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(kc + slots[r] * bytes, k + r * ks, bytes);
    std::memcpy(vc + slots[r] * bytes, v + r * vs, bytes);
  }
}

// Greedy sampling's argmax: out[r] = the index of the first maximum of row r of x [N, V] (row
// stride free), as torch's max(-1).indices: a NaN is the maximum (the first NaN's index). One pass
// per row with 16 running (value, index) lanes, rows split over the threads; torch's bf16 max ran
// on one thread here (~7.5 ms a decode step for 256 x 49152 logits, 4% of the step).
template <typename T>
int64_t argmax_row(const T* row, int64_t v) {
  int64_t i = 0, bi = 0;
  float best = -INFINITY;
  bool nan = false;
#if PAGODA_EW_AVX512
  if (v >= 16) {
    __m512 bv = _mm512_set1_ps(-INFINITY);
    __m512i bidx = _mm512_setzero_si512();
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 anynan = 0;
    for (; i + 16 <= v; i += 16) {
      const __m512 x = load16(row + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(x, bv, _CMP_GT_OQ);  // strict: each lane keeps its first
      anynan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      bv = _mm512_mask_mov_ps(bv, gt, x);
      bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
      idx = _mm512_add_epi32(idx, step);
    }
    nan = anynan != 0;
    best = _mm512_reduce_max_ps(bv);
    // the smallest index among the lanes holding the maximum (all lanes hold index 0 if no value
    // beat -inf: then the row's first element is the answer)
    bi = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(bv, _mm512_set1_ps(best), _CMP_EQ_OQ), bidx);
  }
#endif
  for (; i < v; ++i) {
    const float x = load(row[i]);
    if (x > best) {
      best = x;
      bi = i;
    }
    nan |= std::isnan(x);
  }
  if (nan)
    for (int64_t j = 0; j < v; ++j)
      if (std::isnan(load(row[j]))) return j;
  return bi;
}

void argmax(const at::Tensor& x, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "x must be [N, V] with contiguous rows, V > 0");
  TORCH_CHECK(out.dim() == 1 && out.size(0) == x.size(0) && out.scalar_type() == at::kLong && out.is_contiguous(),
              "out must be a contiguous int64 [N]");
  const int64_t n = x.size(0), v = x.size(1), stride = x.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  switch (x.scalar_type()) {
    case at::kFloat: {
      const float* p = x.data_ptr<float>();
#pragma omp parallel for schedule(static) num_threads(threads_for(n * v))
      for (int64_t r = 0; r < n; ++r) o[r] = argmax_row(p + r * stride, v);
      break;
    }
    case at::kBFloat16: {
      const bf16_t* p = static_cast<const bf16_t*>(x.data_ptr());
#pragma omp parallel for schedule(static) num_threads(threads_for(n * v))
      for (int64_t r = 0; r < n; ++r) o[r] = argmax_row(p + r * stride, v);
      break;
    }
    default:
      TORCH_CHECK(false, "argmax: unsupported dtype ", x.scalar_type());
  }
}

// ---- Random sampling: one pass over each row's logits, no sort and no noise per token ------------
// out[r] for row r of x [N, V] (row stride free), after the row's penalties and min_tokens ban
// (penalise_row, on a float copy): temperature[r] <= 0, the argmax (argmax_row); else one draw from softmax(x / temperature) restricted, in this order, to the tokens whose
// probability is >= min_p[r] x the largest one's (0: all), to the top_k[r] largest (0: all; ties at
// the k-th kept) and to the smallest set of the largest whose mass is >= top_p[r] of what is left
// (1: all; ties at its edge kept): the sampler's filters, in its order. The draw inverts the kept
// tokens' cumulative mass (in index order) at uniform[r] x their total, so a row's token depends on
// its logits and its uniform alone. The torch path (engine_service/sampler.py) sorts the vocabulary
// for top_p and draws an exponential per token: 0.22-0.78 s for 256 rows of 49152 here, against
// a few ms (bench/RESULTS.md).
constexpr int64_t kDrawBlock = 256;  // tokens per partial sum of the draw's search

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// e[i] = exp((x[i] - m) * inv_t) (<= 1: m is the row's maximum), with torch's vectorised exp
// (Sleef, declared for silu_exact above).
template <typename T>
void scaled_exp_row(const T* x, int64_t n, float m, float inv_t, float* e) {
  int64_t i = 0;
#if PAGODA_EW_AVX512
  const __m512 vm = _mm512_set1_ps(m), vs = _mm512_set1_ps(inv_t);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(e + i, Sleef_expf16_u10(_mm512_mul_ps(_mm512_sub_ps(load16(x + i), vm), vs)));
#elif PAGODA_EW_AVX2
  const __m256 vm = _mm256_set1_ps(m), vs = _mm256_set1_ps(inv_t);
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(e + i, Sleef_expf8_u10(_mm256_mul_ps(_mm256_sub_ps(load8(x + i), vm), vs)));
#endif
  for (; i < n; ++i) e[i] = std::exp((load(x[i]) - m) * inv_t);
}

// z[i] = x[i] / T, the torch path's temperature-scaled logits (a division, as `logits /
// temperature`), -0 made +0: the values top_k and top_p rank, so that their ties are its ties.
template <typename T>
void scaled_logits_row(const T* x, int64_t n, float temperature, float* z) {
  int64_t i = 0;
#if PAGODA_EW_AVX512
  const __m512 vt = _mm512_set1_ps(temperature), zero = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(z + i, _mm512_add_ps(_mm512_div_ps(load16(x + i), vt), zero));
#endif
  for (; i < n; ++i) z[i] = load(x[i]) / temperature + 0.f;
}

// A float's bits as an unsigned key that orders as the floats do (-inf lowest; no NaN here).
inline uint32_t order_key(float f) {
  const uint32_t u = float_bits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
inline float key_float(uint32_t k) { return bits_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k); }

// A row's candidates for a threshold: the ordering keys of their z and their mass e.
struct Candidates {
  std::vector<uint32_t> key;
  std::vector<float> mass;
};

// The candidates among e[0..n): e >= lo and z >= zmin; returns how many.
int64_t gather_candidates(const float* e, const float* z, int64_t n, float lo, float zmin, Candidates& c) {
  c.key.resize(static_cast<size_t>(n) + 16);
  c.mass.resize(static_cast<size_t>(n) + 16);
  int64_t i = 0, k = 0;
#if PAGODA_EW_AVX512
  // Most tokens fail: the passing lanes compressed in registers (a compressing store to memory
  // is slow on Zen 4), then keyed.
  const __m512 vlo = _mm512_set1_ps(lo), vz = _mm512_set1_ps(zmin);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i), zv = _mm512_loadu_ps(z + i);
    const __mmask16 m = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(zv, vz, _CMP_GE_OQ);
    if (!m) continue;
    _mm512_storeu_ps(c.mass.data() + k, _mm512_maskz_compress_ps(m, v));
    const __m512i u = _mm512_castps_si512(zv);  // order_key, 16 lanes
    const __m512i key = _mm512_xor_si512(u, _mm512_or_si512(_mm512_srai_epi32(u, 31), _mm512_set1_epi32(INT32_MIN)));
    _mm512_storeu_si512(c.key.data() + k, _mm512_maskz_compress_epi32(m, key));
    k += __builtin_popcount(m);
  }
#endif
  for (; i < n; ++i)
    if (e[i] >= lo && z[i] >= zmin) {
      c.key[k] = order_key(z[i]);
      c.mass[k++] = e[i];
    }
  return k;
}

// Count and mass of the elements with e >= lo and z >= zmin.
std::pair<int64_t, double> count_mass(const float* e, const float* z, int64_t n, float lo, float zmin) {
  int64_t i = 0, count = 0;
  double sum = 0.0;
#if PAGODA_EW_AVX512
  const __m512 vlo = _mm512_set1_ps(lo), vz = _mm512_set1_ps(zmin);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    const __mmask16 k = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(_mm512_loadu_ps(z + i), vz, _CMP_GE_OQ);
    acc = _mm512_mask_add_ps(acc, k, acc, v);
    count += __builtin_popcount(k);
    if ((i & 1023) == 1008) {  // into a double every 1024 elements: the float lanes stay exact enough
      sum += _mm512_reduce_add_ps(acc);
      acc = _mm512_setzero_ps();
    }
  }
  sum += _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i)
    if (e[i] >= lo && z[i] >= zmin) {
      ++count;
      sum += e[i];
    }
  return {count, sum};
}

// The largest key v among the n candidates such that those with key >= v weigh at least `need`:
// counted (by_mass false) or by their mass; the lowest key where they all weigh less (rounding:
// keep them all). A radix selection in 2048 buckets a level, the first over the span of the
// candidates' keys (so they spread out however close their values), each next one over the bucket
// the one before chose (the candidates compacted in place): at most three levels.
uint32_t select_key(Candidates& c, int64_t n, bool by_mass, double need) {
  constexpr int kBits = 11, kBuckets = 1 << kBits;
  double w[kBuckets];
  uint32_t lo = UINT32_MAX, hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    lo = std::min(lo, c.key[i]);
    hi = std::max(hi, c.key[i]);
  }
  int shift = std::max(0, 32 - __builtin_clz((hi - lo) | 1u) - kBits);  // (hi - lo) >> shift < 2048
  uint32_t base = lo;
  bool lowest = false;  // take each level's lowest non-empty bucket: the whole bucket is kept
  while (true) {
    std::fill(w, w + kBuckets, 0.0);
    for (int64_t i = 0; i < n; ++i) w[(c.key[i] - base) >> shift] += by_mass ? static_cast<double>(c.mass[i]) : 1.0;
    double above = 0.0;
    int b = kBuckets - 1;
    if (!lowest)
      for (; b >= 0; --b) {
        if (w[b] > 0.0 && above + w[b] >= need) break;
        above += w[b];
      }
    if (b < 0 || lowest) {
      // Rounding left these candidates a hair below what their sums promised: keep all of this
      // level (its lowest key is the threshold).
      lowest = true;
      for (b = 0; b < kBuckets - 1 && w[b] == 0.0; ++b) {
      }
    }
    need -= above;
    if (shift == 0) return base + static_cast<uint32_t>(b);
    int64_t k = 0;  // the chosen bucket's candidates, for the next level
    for (int64_t i = 0; i < n; ++i)
      if (((c.key[i] - base) >> shift) == static_cast<uint32_t>(b)) {
        c.key[k] = c.key[i];
        c.mass[k++] = c.mass[i];
      }
    n = k;
    base += static_cast<uint32_t>(b) << shift;
    shift = std::max(0, shift - kBits);
  }
}

// e[i] = 0 where e[i] < lo or (z given) z[i] < zmin: the tokens a filter drops.
void drop_below(float* e, const float* z, int64_t n, float lo, float zmin) {
  int64_t i = 0;
#if PAGODA_EW_AVX512
  const __m512 vlo = _mm512_set1_ps(lo), vz = _mm512_set1_ps(zmin);
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(e + i);
    __mmask16 k = _mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ);
    if (z) k &= _mm512_cmp_ps_mask(_mm512_loadu_ps(z + i), vz, _CMP_GE_OQ);
    _mm512_storeu_ps(e + i, _mm512_maskz_mov_ps(k, v));
  }
#endif
  for (; i < n; ++i)
    if (!(e[i] >= lo && (!z || z[i] >= zmin))) e[i] = 0.f;
}

// The sampler's filters on one row, in its order, as thresholds: min_p keeps e >= min_p (e = p /
// p_max); top_k the tokens whose z is >= the k-th largest z of those (ties kept); top_p, of those,
// the ones whose z is >= the largest v such that the tokens >= v hold >= top_p of their mass (ties
// kept). The filtered tokens' e become 0. Each selection runs on the few tokens that can hold its
// answer (e is monotone in z): for top_k, those above the first of 2^-8, 2^-20, 2^-40 that at
// least k pass; for top_p, those >= (1 - top_p) x the mean of the ones it starts from (the ones
// below cannot add up to more than the 1 - top_p of the mass it may drop).
void apply_filters(float* e, const float* z, int64_t n, int64_t top_k, float top_p, float min_p, Candidates& c) {
  const float lo = min_p > 0.f ? min_p : 0.f;
  float zmin = -INFINITY;
  if (top_k > 0 && top_k < n) {
    float from = lo;
    for (const float g : {0x1p-8f, 0x1p-20f, 0x1p-40f})
      if (g > lo && count_mass(e, z, n, g, zmin).first >= top_k) {
        from = g;
        break;
      }
    // (fewer than k candidates only where nothing was cut before the gather: min_p left < k tokens)
    const int64_t m = gather_candidates(e, z, n, from, zmin, c);
    if (m >= top_k) zmin = key_float(select_key(c, m, false, static_cast<double>(top_k)));
  }
  if (top_p < 1.f) {
    const auto [count, mass] = count_mass(e, z, n, lo, zmin);
    const float from = std::max(lo, static_cast<float>((1.0 - top_p) * mass / static_cast<double>(count)) * 0.99f);
    const int64_t m = gather_candidates(e, z, n, from, zmin, c);
    zmin = std::max(zmin, key_float(select_key(c, m, true, static_cast<double>(top_p) * mass)));
  }
  if (lo > 0.f || zmin > -INFINITY) drop_below(e, z, n, lo, zmin);
}

// One row's token (see sample_rows).
template <typename T>
int64_t sample_row(const T* x, int64_t n, float temperature, int64_t top_k, float top_p, float min_p, double u,
                   std::vector<float>& e, std::vector<float>& z, Candidates& cand, std::vector<float>& block) {
  const int64_t j = argmax_row(x, n);
  const float m = load(x[j]);
  if (!(temperature > 0.f) || !std::isfinite(m)) return j;  // greedy; or a NaN / infinite maximum
  e.resize(static_cast<size_t>(n));
  scaled_exp_row(x, n, m, 1.f / temperature, e.data());
  if ((top_k > 0 && top_k < n) || top_p < 1.f) {
    z.resize(static_cast<size_t>(n));
    scaled_logits_row(x, n, temperature, z.data());
    apply_filters(e.data(), z.data(), n, top_k, top_p, min_p, cand);
  } else if (min_p > 0.f) {
    drop_below(e.data(), nullptr, n, min_p, -INFINITY);
  }
  // The kept mass a block of kDrawBlock tokens, then the block and the token where the cumulative
  // mass passes u x the total.
  const int64_t nb = (n + kDrawBlock - 1) / kDrawBlock;
  block.resize(static_cast<size_t>(nb));
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i0 = b * kDrawBlock, i1 = std::min(n, i0 + kDrawBlock);
    float lanes[16] = {};
    int64_t i = i0;
    for (; i + 16 <= i1; i += 16)
      for (int l = 0; l < 16; ++l) lanes[l] += e[i + l];
    float s = 0.f;
    for (int l = 0; l < 16; ++l) s += lanes[l];
    for (; i < i1; ++i) s += e[i];
    block[b] = s;
    total += s;
  }
  const double target = u * total;
  double acc = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (block[b] <= 0.f || acc + block[b] <= target) {
      acc += block[b];
      continue;
    }
    const int64_t i0 = b * kDrawBlock, i1 = std::min(n, i0 + kDrawBlock);
    int64_t last = -1;
    for (int64_t i = i0; i < i1; ++i) {
      if (e[i] <= 0.f) continue;
      acc += e[i];
      last = i;
      if (acc > target) return i;
    }
    return last;  // the float block sum promised a hair more than its tokens add up to in double
  }
  // Unreachable (total > 0: the maximum's e is 1 and passes every filter), but for rounding: the
  // last kept token.
  for (int64_t i = n - 1; i >= 0; --i)
    if (e[i] > 0.f) return i;
  return j;
}

// A row's token ids for the penalties and the min_tokens ban: ids[starts[r] .. starts[r + 1]).
struct RowIds {
  const int64_t* ids = nullptr;
  const int64_t* starts = nullptr;
  int64_t size(int64_t r) const { return starts ? starts[r + 1] - starts[r] : 0; }
  const int64_t* row(int64_t r) const { return starts ? ids + starts[r] : nullptr; }
};

// Scratch of one thread: the penalties' per-token marks, all zero between rows.
struct PenaltyScratch {
  std::vector<int32_t> count;  // output occurrences
  std::vector<uint8_t> seen;   // in the prompt or the output
  std::vector<int64_t> tokens; // the ones marked
};

// x'[t] for a penalised row (the sampler's torch path's arithmetic, each op rounded to float as
// there): the repetition penalty on every token of the prompt or the output (x / r above 0, x * r
// otherwise), then x - frequency x (its output count) - presence x (1 if it is in the output), then
// -inf on the banned ids (a row short of its min_tokens: EOS and the stop ids). Ids outside
// [0, n) are ignored, as the torch path drops them.
void penalise_row(float* x, int64_t n, const float* pen, const int64_t* prompt, int64_t np, const int64_t* output,
                  int64_t no, const int64_t* banned, int64_t nban, PenaltyScratch& ps) {
  const float rep = pen[0], freq = pen[1], pres = pen[2];
  if (rep != 1.f || freq != 0.f || pres != 0.f) {
    ps.count.resize(static_cast<size_t>(n));
    ps.seen.resize(static_cast<size_t>(n));
    ps.tokens.clear();
    auto mark = [&](int64_t t) {
      if (!ps.seen[t]) {
        ps.seen[t] = 1;
        ps.tokens.push_back(t);
      }
    };
    if (rep != 1.f)
      for (int64_t i = 0; i < np; ++i)
        if (prompt[i] >= 0 && prompt[i] < n) mark(prompt[i]);
    for (int64_t i = 0; i < no; ++i)
      if (output[i] >= 0 && output[i] < n) {
        mark(output[i]);
        ++ps.count[output[i]];
      }
    for (const int64_t t : ps.tokens) {
      float v = x[t];
      if (rep != 1.f) v = v > 0.f ? v / rep : v * rep;
      const int32_t c = ps.count[t];
      v = (v - freq * static_cast<float>(c)) - pres * (c > 0 ? 1.f : 0.f);
      x[t] = v;
      ps.seen[t] = 0;
      ps.count[t] = 0;
    }
  }
  for (int64_t i = 0; i < nban; ++i)
    if (banned[i] >= 0 && banned[i] < n) x[banned[i]] = -INFINITY;
}

// run(rows) with x's data as float or bf16_t rows; any other dtype is an error naming `op`.
template <typename Run>
void with_rows_of(const at::Tensor& x, const char* op, Run&& run) {
  switch (x.scalar_type()) {
    case at::kFloat:
      run(x.data_ptr<float>());
      break;
    case at::kBFloat16:
      run(static_cast<const bf16_t*>(x.data_ptr()));
      break;
    default:
      TORCH_CHECK(false, op, ": unsupported dtype ", x.scalar_type());
  }
}

void sample_rows(const at::Tensor& x, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                 const at::Tensor& min_p, const at::Tensor& uniform, const std::optional<at::Tensor>& penalties,
                 const std::optional<at::Tensor>& prompt_ids, const std::optional<at::Tensor>& prompt_starts,
                 const std::optional<at::Tensor>& output_ids, const std::optional<at::Tensor>& output_starts,
                 const std::optional<at::Tensor>& banned_ids, const std::optional<at::Tensor>& banned_starts,
                 at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "sample_rows: x must be [N, V] with contiguous rows, V > 0");
  const int64_t n = x.size(0), v = x.size(1), stride = x.stride(0);
  auto check = [](const at::Tensor& t, int64_t size, at::ScalarType dtype, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == size && t.scalar_type() == dtype && t.is_contiguous(), "sample_rows: ",
                name, " must be a contiguous ", c10::toString(dtype), " [", size, "]");
  };
  check(temperature, n, at::kFloat, "temperature");
  check(top_k, n, at::kLong, "top_k");
  check(top_p, n, at::kFloat, "top_p");
  check(min_p, n, at::kFloat, "min_p");
  check(uniform, n, at::kDouble, "uniform");
  check(out, n, at::kLong, "out");
  const float* pen = nullptr;
  if (penalties) {
    TORCH_CHECK(penalties->dim() == 2 && penalties->size(0) == n && penalties->size(1) == 3 &&
                    penalties->scalar_type() == at::kFloat && penalties->is_contiguous(),
                "sample_rows: penalties must be a contiguous float32 [N, 3] (repetition, frequency, presence)");
    pen = penalties->data_ptr<float>();
  }
  auto ids_of = [&](const std::optional<at::Tensor>& ids, const std::optional<at::Tensor>& starts, const char* name) {
    RowIds r;
    TORCH_CHECK(ids.has_value() == starts.has_value(), "sample_rows: ", name, " ids and starts go together");
    if (!ids) return r;
    check(*starts, n + 1, at::kLong, name);
    TORCH_CHECK(ids->dim() == 1 && ids->scalar_type() == at::kLong && ids->is_contiguous(), "sample_rows: ", name,
                " ids must be a contiguous int64 [M]");
    r.starts = starts->data_ptr<int64_t>();
    TORCH_CHECK(r.starts[0] == 0 && r.starts[n] == ids->size(0), "sample_rows: ", name, " starts must run from 0 to ",
                ids->size(0));
    for (int64_t i = 0; i < n; ++i) TORCH_CHECK(r.starts[i] <= r.starts[i + 1], "sample_rows: ", name, " starts must not decrease");
    r.ids = ids->data_ptr<int64_t>();
    return r;
  };
  const RowIds prompt = ids_of(prompt_ids, prompt_starts, "prompt"), output = ids_of(output_ids, output_starts, "output"),
               banned = ids_of(banned_ids, banned_starts, "banned");
  TORCH_CHECK(pen || (!prompt.starts && !output.starts), "sample_rows: prompt / output ids need penalties");
  const float* temp = temperature.data_ptr<float>();
  const int64_t* k = top_k.data_ptr<int64_t>();
  const float* p = top_p.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const double* u = uniform.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  auto run = [&](const auto* base) {
#pragma omp parallel num_threads(threads_for(n * v))
    {
      std::vector<float> e, z, block, row;
      Candidates cand;
      PenaltyScratch ps;
#pragma omp for schedule(dynamic, 1)
      for (int64_t r = 0; r < n; ++r) {
        const auto* xr = base + r * stride;
        const bool penalised = pen && (pen[3 * r] != 1.f || pen[3 * r + 1] != 0.f || pen[3 * r + 2] != 0.f);
        if (penalised || banned.size(r)) {  // on a float copy: the caller's logits stay as they are
          row.resize(static_cast<size_t>(v));
          for (int64_t i = 0; i < v; ++i) row[i] = load(xr[i]);
          const float none[3] = {1.f, 0.f, 0.f};
          penalise_row(row.data(), v, penalised ? pen + 3 * r : none, prompt.row(r), prompt.size(r), output.row(r),
                       output.size(r), banned.row(r), banned.size(r), ps);
          o[r] = sample_row(row.data(), v, temp[r], k[r], p[r], mp[r], u[r], e, z, cand, block);
        } else {
          o[r] = sample_row(xr, v, temp[r], k[r], p[r], mp[r], u[r], e, z, cand, block);
        }
      }
    }
  };
  with_rows_of(x, "sample_rows", run);
}

// ---- Logprobs of the raw logits: two passes a row, no [N, V] log_softmax and no sort -------------
// For row r of x [N, V] (rows contiguous, row stride free): token_lp[r] = x[r][tokens[r]] - m - log(s)
// with m the row's maximum and s = sum exp(x - m) (torch's log_softmax: a float log of the sum, then
// (x - m) - that log; the sum in float lanes, added into a double every 1024 tokens), token_rank[r] =
// 1 + how many logits are above the token's (its rank in the vocabulary, as vLLM's), and the k largest
// logits' ids and logprobs, largest first, equal values by lower index (torch.topk leaves their order
// open). A NaN ranks lowest among the top k and makes the row's logprobs NaN, as log_softmax's. The
// torch path (log_softmax, gather, topk over [N, V] float32, after a float copy of bf16 logits) took
// ~24 ms for 256 rows of 49152 here (bench/RESULTS.md).

// Whether (v, id) goes before (kv, kid) in a top-k list: larger first, equal values by lower id.
inline bool top_before(float v, int64_t id, float kv, int64_t kid) { return v > kv || (v == kv && id < kid); }

// Puts (v, id) into the k-long list vals / ids (ordered by top_before) if it goes before the last.
inline void top_insert(float v, int64_t id, int64_t k, float* vals, int64_t* ids) {
  if (!top_before(v, id, vals[k - 1], ids[k - 1])) return;
  int64_t p = k - 1;
  while (p > 0 && top_before(v, id, vals[p - 1], ids[p - 1])) {
    vals[p] = vals[p - 1];
    ids[p] = ids[p - 1];
    --p;
  }
  vals[p] = v;
  ids[p] = id;
}

// The k largest of x[0..n) (k <= n), descending, equal values by lower index: the first k by
// insertion, then one pass that inserts only what beats the current k-th (rarely past the start).
template <typename T>
void top_k_row(const T* x, int64_t n, int64_t k, int64_t* ids, float* vals) {
  std::fill(vals, vals + k, -INFINITY);
  std::fill(ids, ids + k, INT64_MAX);
  for (int64_t i = 0; i < k; ++i) {
    const float v = load(x[i]);
    top_insert(std::isnan(v) ? -INFINITY : v, i, k, vals, ids);
  }
  float kth = vals[k - 1];
  int64_t i = k;
#if PAGODA_EW_AVX512
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16(x + i);
    __mmask16 gt = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kth), _CMP_GT_OQ);
    if (!gt) continue;
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, v);
    for (; gt; gt &= gt - 1) {
      const int l = __builtin_ctz(gt);
      if (lanes[l] > kth) {
        top_insert(lanes[l], i + l, k, vals, ids);
        kth = vals[k - 1];
      }
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = load(x[i]);
    if (v > kth) {
      top_insert(v, i, k, vals, ids);
      kth = vals[k - 1];
    }
  }
}

// sum exp(x[i] - m) over x[0..n), with torch's vectorised exp (Sleef), and how many x[i] are > xt.
template <typename T>
double exp_sum_row(const T* x, int64_t n, float m, float xt, int64_t& above) {
  double sum = 0.0;
  int64_t i = 0, count = 0;
#if PAGODA_EW_AVX512
  const __m512 vm = _mm512_set1_ps(m), vt = _mm512_set1_ps(xt);
  while (i + 16 <= n) {
    __m512 acc = _mm512_setzero_ps();
    for (const int64_t end = std::min(n, i + 1024); i + 16 <= end; i += 16) {
      const __m512 v = load16(x + i);
      acc = _mm512_add_ps(acc, Sleef_expf16_u10(_mm512_sub_ps(v, vm)));
      count += __builtin_popcount(_mm512_cmp_ps_mask(v, vt, _CMP_GT_OQ));
    }
    sum += _mm512_reduce_add_ps(acc);
  }
#elif PAGODA_EW_AVX2
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(xt);
  while (i + 8 <= n) {
    __m256 acc = _mm256_setzero_ps();
    for (const int64_t end = std::min(n, i + 1024); i + 8 <= end; i += 8) {
      const __m256 v = load8(x + i);
      acc = _mm256_add_ps(acc, Sleef_expf8_u10(_mm256_sub_ps(v, vm)));
      count += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(v, vt, _CMP_GT_OQ)));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    for (const float l : lanes) sum += l;
  }
#endif
  for (; i < n; ++i) {
    const float v = load(x[i]);
    sum += std::exp(v - m);
    count += v > xt;
  }
  above = count;
  return sum;
}

void logprobs_rows(const at::Tensor& x, const at::Tensor& tokens, at::Tensor& token_lp, at::Tensor& token_rank,
                   at::Tensor& topk_ids, at::Tensor& topk_lp) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0, "logprobs_rows: x must be [N, V] with contiguous rows, V > 0");
  const int64_t n = x.size(0), v = x.size(1), stride = x.stride(0), k = topk_ids.dim() == 2 ? topk_ids.size(1) : -1;
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == n && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "logprobs_rows: tokens must be a contiguous int64 [", n, "]");
  TORCH_CHECK(token_lp.dim() == 1 && token_lp.size(0) == n && token_lp.scalar_type() == at::kFloat && token_lp.is_contiguous(),
              "logprobs_rows: token_lp must be a contiguous float32 [", n, "]");
  TORCH_CHECK(token_rank.dim() == 1 && token_rank.size(0) == n && token_rank.scalar_type() == at::kLong &&
                  token_rank.is_contiguous(),
              "logprobs_rows: token_rank must be a contiguous int64 [", n, "]");
  TORCH_CHECK(k >= 0 && k <= v && topk_ids.size(0) == n && topk_ids.scalar_type() == at::kLong && topk_ids.is_contiguous(),
              "logprobs_rows: topk_ids must be a contiguous int64 [", n, ", K] with K <= ", v);
  TORCH_CHECK(topk_lp.dim() == 2 && topk_lp.size(0) == n && topk_lp.size(1) == k && topk_lp.scalar_type() == at::kFloat &&
                  topk_lp.is_contiguous(),
              "logprobs_rows: topk_lp must be a contiguous float32 [", n, ", ", k, "]");
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r)
    TORCH_CHECK(t[r] >= 0 && t[r] < v, "logprobs_rows: tokens[", r, "] is ", t[r], ", outside [0, ", v, ")");
  float* lp = token_lp.data_ptr<float>();
  int64_t* rank = token_rank.data_ptr<int64_t>();
  int64_t* ids = topk_ids.data_ptr<int64_t>();
  float* top = topk_lp.data_ptr<float>();
  auto run = [&](const auto* base) {
#pragma omp parallel for schedule(static) num_threads(threads_for(n * v))
    for (int64_t r = 0; r < n; ++r) {
      const auto* xr = base + r * stride;
      float m;
      if (k > 0) {
        top_k_row(xr, v, k, ids + r * k, top + r * k);
        m = top[r * k];  // NaN ranks lowest, so a NaN row's maximum is still a number; its sum is not
      } else {
        m = load(xr[argmax_row(xr, v)]);
      }
      const float xt = load(xr[t[r]]);
      int64_t above;
      const float lse = std::log(static_cast<float>(exp_sum_row(xr, v, m, xt, above)));
      lp[r] = (xt - m) - lse;
      rank[r] = above + 1;
      for (int64_t j = 0; j < k; ++j) top[r * k + j] = (top[r * k + j] - m) - lse;
    }
  };
  with_rows_of(x, "logprobs_rows", run);
}

// ---- GEMMs of our own: bf16 on AMX tiles or AVX512-BF16 dot products, float32 on FMAs ------------
// y = x @ W^T for x [M, K] and a weight packed once by gemm_pack_weight, 64 output columns per block:
//   bf16: [N/64][K/2][64][2], the VNNI pair layout both bf16 instruction sets read;
//   float32: [N/64][64/P][K][P], each block as 64/P panels of P = kGemmPanelF32 columns (64 with
//     AVX-512, 16 with AVX2), a panel's k rows in order.
// For each 256-row slice of x, each thread takes a run of column blocks (and some rows of the blocks
// at its run's ends), so a weight block is read about once per slice and a row's value never depends
// on how many rows the call has (oneDNN's own GEMMs pick another K order at some row counts than at
// others). A bf16 block is multiplied by torch's cpublas::brgemm (oneDNN's AMX micro-kernel) where
// the CPU has AMX-BF16, else by dp_rows below (vdpbf16ps, fp32 sums); a float32 block by f32_rows
// (6 rows x P columns of FMAs). Against oneDNN's packed linear (bench/bf16_gemm.py,
// bench/fp32_linear_ab.py, bench/RESULTS.md): bf16 on a 2-core Xeon with AMX 1.1-2.5x faster from 8
// to ~1024 rows and slower above (the model calls it below that: CpuLayerOps.gemm_max_rows); on a
// 2-core Zen 4 1.0-2.0x at every row count, most where the weight or inputs are cold; float32 on a
// 2-core Zen 3 (AVX2) 1.0-1.2x from 64 to 2048 rows and 1.1-1.6x at 8 (and W in float32 3% faster),
// on a 2-core Zen 4 (AVX-512) 0.93-1.14x from 64 to 2048 rows and 1.1-1.7x at 8 (W in float32 +7%).
// The float32 kernel also takes bf16 x, on float32 weights or on bf16 weights packed in its layout
// (gemm_pack_weight(w, float32_kernel=true): a bf16 model on a CPU without bf16 dot products): x is
// widened once and the weight in registers as the kernel loads it, both exactly, and each output
// rounded to bf16, as llama.py's linear() computes it on oneDNN with float32 copies of the weights.
// The fused forms:
//   gemm_linear_silu_mul: gate/up blocks interleaved, the epilogue writes silu(gate) * up;
//   gemm_linear_rotary_to_cache: one block per head of the fused QKV output, the epilogue writes
//     rotary(q), and rotary(k) and v straight into their cache slots.
// Each fused form gives bitwise what gemm_linear followed by the unfused op gives.
constexpr int64_t kGemmBlockN = 64;
constexpr int64_t kGemmBlockM = 256;
// Columns of a float32 panel: one block's 64 (four zmm registers a row) where the compiler targets
// AVX-512, 16 (two ymm) on AVX2. Either way a row's sums run k in order from zero, one FMA per k, so
// both give the same bits.
#if PAGODA_EW_AVX512
constexpr int64_t kGemmPanelF32 = 64;
#else
constexpr int64_t kGemmPanelF32 = 16;
#endif

#if PAGODA_EW_AVX512 && defined(__AVX512BF16__)
#define PAGODA_GEMM_BF16 1
#else
#define PAGODA_GEMM_BF16 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define PAGODA_GEMM_F32 1
#else
#define PAGODA_GEMM_F32 0
#endif

bool gemm_uses_amx() {
#if PAGODA_GEMM_BF16
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool amx = (d >> 22 & 1) && (d >> 24 & 1);  // AMX-BF16, AMX-TILE
    return amx && at::native::cpublas::could_pack(at::kBFloat16);
  }();
  return ok;
#else
  return false;
#endif
}

// Built for a CPU with AVX512-BF16 (-march=native): dp_rows runs here, AMX or not.
bool gemm_supported() { return PAGODA_GEMM_BF16; }

// Built for a CPU with AVX2 and FMA: the float32 GEMMs run here (the engine uses them where the CPU
// has no AVX-512: CpuLayerOps).
bool gemm_f32_supported() { return PAGODA_GEMM_F32; }

// A weight packed for the float32 kernel: float32 [N/64][64/P][K][P], or bf16 in that shape with
// each k's P columns in the pair layout below (float32_kernel: a bf16 model on a CPU without bf16
// dot products), widened in registers as the kernel loads them. The bf16 kernels' layout ends in
// pairs of k (size 2), this one in P >= 16 columns.
inline bool f32_kernel(const at::Tensor& packed) {
  return packed.scalar_type() == at::kFloat ||
         (packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(3) == kGemmPanelF32);
}

at::Tensor gemm_pack_weight(const at::Tensor& weight, bool float32_kernel) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "weight must be bf16 or float32 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  if (weight.scalar_type() == at::kFloat || float32_kernel) {
    TORCH_CHECK(gemm_f32_supported(), "gemm_pack_weight: the float32 kernel needs a CPU with AVX2 and FMA");
    TORCH_CHECK(n % kGemmBlockN == 0 && k > 0, "weight [", n, ", ", k, "]: N must be a multiple of ", kGemmBlockN);
    const int64_t panels = kGemmBlockN / kGemmPanelF32;  // [N/64][64/P][K][P]
    const at::Tensor out = weight.reshape({n / kGemmBlockN, panels, kGemmPanelF32, k}).transpose(2, 3);
    if (weight.scalar_type() == at::kFloat) return out.contiguous();
    // bf16: the pair layout, each k's P columns as groups of 2L (L: the kernel's float32 lanes),
    // column i of a group beside column L + i, so a 32-bit lane widens to either by a shift or a mask.
    constexpr int64_t lanes = kGemmPanelF32 == 64 ? 16 : 8;
    return out.reshape({n / kGemmBlockN, panels, k, kGemmPanelF32 / (2 * lanes), 2, lanes})
        .transpose(4, 5)
        .reshape({n / kGemmBlockN, panels, k, kGemmPanelF32})
        .contiguous();
  }
  TORCH_CHECK(gemm_supported(), "gemm_pack_weight: this CPU has no AVX512-BF16 or AMX-BF16");
  TORCH_CHECK(n % kGemmBlockN == 0 && k % 2 == 0, "weight [", n, ", ", k, "]: N must be a multiple of ",
              kGemmBlockN, " and K even");
  if (!gemm_uses_amx())  // [N/64][K/2][64][2]
    return weight.reshape({n / kGemmBlockN, kGemmBlockN, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
  const at::Tensor wt = weight.t().contiguous();  // [K, N]: B of x @ B
  at::Tensor out = at::empty({n / kGemmBlockN, k / 2, kGemmBlockN, 2}, weight.options());
  const auto* src = static_cast<const at::BFloat16*>(wt.data_ptr());
  auto* dst = static_cast<at::BFloat16*>(out.data_ptr());
  for (int64_t nb = 0; nb < n / kGemmBlockN; ++nb)
    at::native::cpublas::pack(k, kGemmBlockN, n, kGemmBlockN, at::kBFloat16, at::kBFloat16, src + nb * kGemmBlockN,
                              dst + nb * k * kGemmBlockN);
  return out;
}

// For the tests: a thread of every GEMM call that sleeps first (as if the OS had preempted it), and
// how many times a thread has taken another's work.
std::atomic<int64_t> g_gemm_stall_thread{-1}, g_gemm_stall_us{0}, g_gemm_steals{0};

// GEMM trace (bench/gemm_trace.py), off unless gemm_trace(true) turned it on: each run_gemm_blocks
// claim adds {thread, group, rows, tsc at its start, after multiply, after its epilogue, blocks a
// group}, and each thread at the end of a call {thread, -1, threads, tsc at the region's start, at
// its end, groups, K}: the call's shape names the GEMM, whichever of the layer's GEMMs ran elsewhere.
constexpr int64_t kTraceCap = 1 << 16, kTraceCols = 7;
std::atomic<bool> g_trace_on{false};
std::atomic<int64_t> g_trace_n{0};
int64_t g_trace[kTraceCap][kTraceCols];
inline uint64_t tsc_now() {  // the time-stamp counter (a fixed rate, whatever the core clock does)
#if defined(__x86_64__) || defined(__i386__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}
inline void trace_add(int64_t a, int64_t b, int64_t c, uint64_t d, uint64_t e, uint64_t f, int64_t g) {
  const int64_t i = g_trace_n.fetch_add(1, std::memory_order_relaxed);
  if (i >= kTraceCap) return;
  int64_t* row = g_trace[i];
  row[0] = a, row[1] = b, row[2] = c, row[3] = static_cast<int64_t>(d), row[4] = static_cast<int64_t>(e),
  row[5] = static_cast<int64_t>(f), row[6] = g;
}
// Returns what was recorded since the last call ([n, kTraceCols] int64, at most kTraceCap rows) and
// turns the trace on or off.
at::Tensor gemm_trace(bool on) {
  g_trace_on.store(false);
  const int64_t n = std::min(g_trace_n.exchange(0), kTraceCap);
  at::Tensor t = at::empty({n, kTraceCols}, at::kLong);
  std::memcpy(t.data_ptr<int64_t>(), g_trace, n * kTraceCols * sizeof(int64_t));
  g_trace_on.store(on);
  return t;
}
int64_t gemm_tsc() { return static_cast<int64_t>(tsc_now()); }

// GEMM calls of at most this many rows on dp_rows (bf16, AVX512-BF16) or f32_rows, one pass over
// each weight block, where the weights stream through once, fetch them non-temporally (prefetchnta
// on each line just before its load): they then do not evict what the rest of the step keeps in
// L2 and L3 (the K/V, the activations, the host's code and data, which every torch op after a
// 269 MB pass over the weights fetched from DRAM again: torch.empty 1 -> 40 us). Zen 4, steps
// alternating 20 at a time in one process (bench/host_share.py --against-nta-rows 0): one sequence
// decoding 1.06-1.13x a step, two 1.00-1.06x, four 1.08x; a float32 model, one sequence,
// 1.04-1.09x. 0 to 6; 0: never. gemm_set_nta_rows sets it and returns the old value.
std::atomic<int64_t> g_gemm_nta_rows{6};
int64_t gemm_set_nta_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0 && rows <= 6, "gemm_set_nta_rows: rows must be in [0, 6] (0: never), got ", rows);
  return g_gemm_nta_rows.exchange(rows);
}
// Whether a call of m rows reads its weights non-temporally.
inline bool gemm_reads_nta(int64_t m) {
  return m <= std::min<int64_t>(6, g_gemm_nta_rows.load(std::memory_order_relaxed));
}

void gemm_test_stall(int64_t thread, int64_t microseconds) {
  TORCH_CHECK(microseconds >= 0 && microseconds <= 1000000, "gemm_test_stall: microseconds must be in [0, 1e6], got ",
              microseconds);
  g_gemm_stall_us.store(microseconds);
  g_gemm_stall_thread.store(thread);
}

int64_t gemm_steals() { return g_gemm_steals.load(); }

// Splits x's m rows into 256-row slices and, in each, the slice's (group, row) pairs evenly over the
// threads in group-major order: a thread takes whole groups and part of the rows of one at each end
// (o_proj's 9 blocks would leave threads 4 against 5). multiply(row0, rows, g, c) fills c[b][r][64]
// with the fp32 products of those rows with the group's blocks b; epilogue(row0, rows, g, c) takes
// them; finish() runs on each thread at the end. k (the products' inner dimension) is for the trace.
//
// A thread works through its shares from the front, one group's rows at a time; one that has run
// out takes the back of another's (a group's rows, or the back half of the last one left), so a
// thread the OS preempts (the engine service's event loop, a neighbour on the host) holds the call
// up by the work it has in hand, not by its whole share. Each share is one atomic word (front, back):
// every (group, row) pair is claimed exactly once, and a row's sums do not depend on which thread or
// how many rows at a time computes them, so the output is the same bits whoever takes what.
template <typename Multiply, typename Epilogue, typename Finish>
void run_gemm_blocks(int64_t m, int64_t groups, int64_t group, int64_t k, Multiply&& multiply,
                     Epilogue&& epilogue, Finish&& finish) {
  if (m == 0) return;
  const int nt = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), groups * m));
  const int64_t slices = (m + kGemmBlockM - 1) / kGemmBlockM;
  const auto pack = [](int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  };
  std::vector<std::atomic<uint64_t>> shares(slices * nt);
  for (int64_t s = 0; s < slices; ++s) {
    const int64_t units = groups * std::min(kGemmBlockM, m - s * kGemmBlockM);
    for (int t = 0; t < nt; ++t) shares[s * nt + t].store(pack(units * t / nt, units * (t + 1) / nt));
  }
#pragma omp parallel num_threads(nt)
  {
    const bool trace = g_trace_on.load(std::memory_order_relaxed);
    const uint64_t t_region = trace ? tsc_now() : 0;
    static thread_local std::vector<float> buf;
    buf.resize(group * kGemmBlockM * kGemmBlockN);
    const int t = omp_get_thread_num();
    if (g_gemm_stall_thread.load(std::memory_order_relaxed) == t)
      std::this_thread::sleep_for(std::chrono::microseconds(g_gemm_stall_us.load(std::memory_order_relaxed)));
    // Claims units [lo, hi) of slice s from share t2 (its owner from the front, others from the back).
    const auto claim = [&](int64_t s, int t2, int64_t rows, int64_t& lo, int64_t& hi) {
      std::atomic<uint64_t>& share = shares[s * nt + t2];
      uint64_t cur = share.load(std::memory_order_relaxed);
      for (;;) {
        const int64_t front = static_cast<uint32_t>(cur), back = static_cast<int64_t>(cur >> 32);
        if (front >= back) return false;
        uint64_t next;
        if (t2 == t) {
          lo = front;
          hi = std::min((front / rows + 1) * rows, back);
          next = pack(hi, back);
        } else {
          hi = back;
          lo = std::max((back - 1) / rows * rows, front);
          if (lo == front && back - front > 12) lo = front + (back - front) / 12 * 6;  // the back half
          next = pack(front, lo);
        }
        if (share.compare_exchange_weak(cur, next, std::memory_order_relaxed)) {
          if (t2 != t) g_gemm_steals.fetch_add(1, std::memory_order_relaxed);
          return true;
        }
      }
    };
    const auto run = [&](int64_t s, int64_t rows, int64_t lo, int64_t hi) {
      const int64_t g = lo / rows, r = s * kGemmBlockM + lo % rows, len = hi - lo;
      const uint64_t t0 = trace ? tsc_now() : 0;
      multiply(r, len, g, buf.data());
      const uint64_t t1 = trace ? tsc_now() : 0;
      epilogue(r, len, g, buf.data());
      if (trace) trace_add(t, g, len, t0, t1, tsc_now(), group);
    };
    int64_t lo, hi;
    for (int64_t s = 0; s < slices; ++s) {
      const int64_t rows = std::min(kGemmBlockM, m - s * kGemmBlockM);
      while (claim(s, t, rows, lo, hi)) run(s, rows, lo, hi);
    }
    for (int64_t s = 0; s < slices; ++s) {
      const int64_t rows = std::min(kGemmBlockM, m - s * kGemmBlockM);
      for (int d = 1; d < nt; ++d)
        while (claim(s, (t + d) % nt, rows, lo, hi)) run(s, rows, lo, hi);
    }
    finish();
    if (trace) trace_add(t, -1, nt, t_region, tsc_now(), groups, k);
  }
}

#if PAGODA_GEMM_BF16
// The GEMM output rounded to bf16 as oneDNN rounds it (vcvtneps2bf16).
inline __m256i gemm_round16(const float* c) { return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(c)); }
// A block row of the bf16 kernels' fp32 sums as gemm_linear stores it.
inline void gemm_round_block_row(const float* c, bf16_t* dst) {
  for (int64_t j = 0; j < kGemmBlockN; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), gemm_round16(c + j));
}
inline __m512 bits_to_f32(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

// c[rows][64] = a[rows][k] @ b for one 64-column block b [k/2][64][2] with AVX512-BF16 dot products
// (vdpbf16ps: a pair of products added to an fp32 sum), R rows at a time, each row's 64 sums in four
// registers, k in order: a row's sums do not depend on R. 6 rows: 24 sums, 4 weight vectors and a
// broadcast fill the 32 registers; the weight block (72-192 KB at SmolLM2's shapes) comes from L2
// for every 6 rows after the first.
template <int R, bool NTA = false>
inline void dp_rows(int64_t pairs, const uint32_t* a, int64_t lda, const uint16_t* b, float* c) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* bp = b + p * 2 * kGemmBlockN;
    if constexpr (NTA)  // the four lines loaded next, non-temporally (g_gemm_nta_rows)
      for (int l = 0; l < 4; ++l) _mm_prefetch(reinterpret_cast<const char*>(bp) + 64 * l, _MM_HINT_NTA);
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 32),
                   b2 = (__m512bh)_mm512_loadu_si512(bp + 64), b3 = (__m512bh)_mm512_loadu_si512(bp + 96);
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], av, b3);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(c + r * kGemmBlockN + j * 16, acc[r][j]);
}

inline void dp_gemm(int64_t m, int64_t k, const at::BFloat16* a, int64_t lda, const at::BFloat16* b, float* c) {
  const auto* a32 = reinterpret_cast<const uint32_t*>(a);
  const auto* b16 = reinterpret_cast<const uint16_t*>(b);
  const int64_t pairs = k / 2, lda32 = lda / 2;
  using Rows = void (*)(int64_t, const uint32_t*, int64_t, const uint16_t*, float*);
  static constexpr Rows kRows[] = {nullptr, dp_rows<1>, dp_rows<2>, dp_rows<3>, dp_rows<4>, dp_rows<5>, dp_rows<6>};
  static constexpr Rows kRowsNta[] = {nullptr,          dp_rows<1, true>, dp_rows<2, true>, dp_rows<3, true>,
                                      dp_rows<4, true>, dp_rows<5, true>, dp_rows<6, true>};
  const Rows* table = gemm_reads_nta(m) ? kRowsNta : kRows;
  for (int64_t r = 0; r < m; r += 6)
    table[std::min<int64_t>(6, m - r)](pairs, a32 + r * lda32, lda32, b16, c + r * kGemmBlockN);
}
#endif

#if PAGODA_GEMM_F32 && PAGODA_EW_AVX512
// c[R][64] = a[R][k] @ one 64-column block b [k][64]: per k four weight vectors, R broadcasts and 4R
// FMAs, k in order. 6 rows: 24 sums, 4 weight vectors and a broadcast in AVX-512's 32 registers
// (the bf16 dp_rows' shape); each x value is broadcast once per block, not once per 16 columns.
// W = bf16_t: a bf16 block in the pair layout (gemm_pack_weight), each k's 64 weights two vectors
// of 32, each widened exactly by a shift (columns 0-15 of the 32) and a mask (16-31).
template <int R, typename W, bool NTA = false>
inline void f32_rows(int64_t k, const float* a, int64_t lda, const W* b, float* c) {
  __m512 s0[R], s1[R], s2[R], s3[R];
  const float* ar[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    s0[r] = s1[r] = s2[r] = s3[r] = _mm512_setzero_ps();
    ar[r] = a + r * lda;
  }
  for (int64_t p = 0; p < k; ++p) {
    const W* bp = b + p * kGemmPanelF32;
    if constexpr (NTA)  // the lines loaded next, non-temporally (g_gemm_nta_rows)
      for (size_t l = 0; l < kGemmPanelF32 * sizeof(W); l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(bp) + l, _MM_HINT_NTA);
    __m512 b0, b1, b2, b3;
    if constexpr (std::is_same_v<W, bf16_t>) {
      const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
      const __m512i v0 = _mm512_loadu_si512(bp), v1 = _mm512_loadu_si512(bp + 32);
      b0 = _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16));
      b1 = _mm512_castsi512_ps(_mm512_and_si512(v0, hi));
      b2 = _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16));
      b3 = _mm512_castsi512_ps(_mm512_and_si512(v1, hi));
    } else {
      b0 = _mm512_loadu_ps(bp), b1 = _mm512_loadu_ps(bp + 16), b2 = _mm512_loadu_ps(bp + 32);
      b3 = _mm512_loadu_ps(bp + 48);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 av = _mm512_set1_ps(ar[r][p]);
      s0[r] = _mm512_fmadd_ps(av, b0, s0[r]);
      s1[r] = _mm512_fmadd_ps(av, b1, s1[r]);
      s2[r] = _mm512_fmadd_ps(av, b2, s2[r]);
      s3[r] = _mm512_fmadd_ps(av, b3, s3[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    float* cr = c + r * kGemmBlockN;
    _mm512_storeu_ps(cr, s0[r]);
    _mm512_storeu_ps(cr + 16, s1[r]);
    _mm512_storeu_ps(cr + 32, s2[r]);
    _mm512_storeu_ps(cr + 48, s3[r]);
  }
}
#elif PAGODA_GEMM_F32
// c[R][16] (row stride 64) = a[R][k] @ one 16-column panel b [k][16]: per k two weight vectors, R
// broadcasts and 2R FMAs, k in order (a row's sums do not depend on R). 6 rows: 12 sums, 2 weight
// vectors and a broadcast in AVX2's 16 registers. The arrays stay in registers only with the r
// loops unrolled (gcc spilled acc[R][2] to the stack on every k).
// W = bf16_t: a bf16 panel in the pair layout, each k's 16 weights one vector widened by a shift
// (columns 0-7) and a mask (8-15).
template <int R, typename W, bool NTA = false>
inline void f32_rows(int64_t k, const float* a, int64_t lda, const W* b, float* c) {
  __m256 lo[R], hi[R];
  const float* ar[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    lo[r] = hi[r] = _mm256_setzero_ps();
    ar[r] = a + r * lda;
  }
  for (int64_t p = 0; p < k; ++p) {
    __m256 b0, b1;
    if constexpr (NTA)  // the line loaded next (a bf16 panel's every other k: the same line twice)
      _mm_prefetch(reinterpret_cast<const char*>(b + p * kGemmPanelF32), _MM_HINT_NTA);
    if constexpr (std::is_same_v<W, bf16_t>) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + p * kGemmPanelF32));
      b0 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
      b1 = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
    } else {
      b0 = _mm256_loadu_ps(b + p * kGemmPanelF32), b1 = _mm256_loadu_ps(b + p * kGemmPanelF32 + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 av = _mm256_broadcast_ss(ar[r] + p);
      lo[r] = _mm256_fmadd_ps(av, b0, lo[r]);
      hi[r] = _mm256_fmadd_ps(av, b1, hi[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(c + r * kGemmBlockN, lo[r]);
    _mm256_storeu_ps(c + r * kGemmBlockN + 8, hi[r]);
  }
}

#endif

#if PAGODA_GEMM_F32
// c[m][64] = a[m][k] @ one 64-column block b [64/P][k][P] (float32, or bf16 in the pair layout):
// 6 rows at a time through the block's panels, so the rows' 6 x k inputs stay in L1 while the
// block (144-384 KB at SmolLM2's shapes in float32, half that in bf16) streams from L2.
template <typename W>
inline void f32_gemm(int64_t m, int64_t k, const float* a, int64_t lda, const W* b, float* c) {
  using Rows = void (*)(int64_t, const float*, int64_t, const W*, float*);
  static constexpr Rows kRows[] = {nullptr,       f32_rows<1, W>, f32_rows<2, W>, f32_rows<3, W>,
                                   f32_rows<4, W>, f32_rows<5, W>, f32_rows<6, W>};
  static constexpr Rows kRowsNta[] = {nullptr,              f32_rows<1, W, true>, f32_rows<2, W, true>,
                                      f32_rows<3, W, true>, f32_rows<4, W, true>, f32_rows<5, W, true>,
                                      f32_rows<6, W, true>};
  const Rows* table = gemm_reads_nta(m) ? kRowsNta : kRows;
  for (int64_t r = 0; r < m; r += 6) {
    const Rows rows = table[std::min<int64_t>(6, m - r)];
    for (int64_t s = 0; s < kGemmBlockN / kGemmPanelF32; ++s)
      rows(k, a + r * lda, lda, b + s * k * kGemmPanelF32, c + r * kGemmBlockN + s * kGemmPanelF32);
  }
}
#endif

// A block row of float32 products rounded to bf16 (nearest even, as torch's float -> bfloat16):
// what a bf16 model's GEMM on float32 weights stores (llama.py's linear() rounds alike).
inline void round_block_row(const float* c, bf16_t* dst) {
#if PAGODA_EW_VEC
  for (int64_t j = 0; j < kGemmBlockN; j += Vec::kLanes) Vec::store(dst + j, Vec::load(c + j));
#else
  for (int64_t j = 0; j < kGemmBlockN; ++j) store(c[j], dst + j);
#endif
}

// Calls body(m, k, groups, multiply, finish) with run_gemm's kernel for x [M, K] and `groups`
// groups of `group` consecutive column blocks of the packed weight: multiply(r, len, g, c) writes the
// fp32 products of rows r .. r + len with group g to c[b][len][64] (a row's products do not depend
// on len); finish() ends a thread's share of the calls (AMX: releases the tiles).
template <typename Body>
void with_gemm_kernel(const at::Tensor& x_in, const at::Tensor& packed, int64_t group, Body&& body) {
  // The float32 kernel with bf16 x (a bf16 model on a CPU without bf16 dot products): x widened
  // once, exactly.
  const bool f32 = f32_kernel(packed);
  const at::Tensor x = f32 && x_in.scalar_type() != at::kFloat ? x_in.to(at::kFloat) : x_in;
  const int64_t m = x.size(0), k = x.size(1), lda = x.stride(0), block = k * kGemmBlockN;
  const int64_t groups = packed.size(0) / group, cblock = kGemmBlockM * kGemmBlockN;
  if (f32) {
#if PAGODA_GEMM_F32
    const float* a = x.data_ptr<float>();
    const auto multiply = [&](const auto* b) {
      body(
          m, k, groups,
          [&](int64_t r, int64_t len, int64_t g, float* c) {
            for (int64_t j = 0; j < group; ++j)
              f32_gemm(len, k, a + r * lda, lda, b + (g * group + j) * block, c + j * cblock);
          },
          [] {});
    };
    // bf16 weights are widened in registers as the kernel loads them: bitwise what float32
    // copies of them give, from half the weight bytes.
    if (packed.scalar_type() == at::kFloat)
      multiply(packed.data_ptr<float>());
    else
      multiply(static_cast<const bf16_t*>(packed.data_ptr()));
#endif
    return;
  }
#if PAGODA_GEMM_BF16
  const auto* a = static_cast<const at::BFloat16*>(x.data_ptr());
  const auto* b = static_cast<const at::BFloat16*>(packed.data_ptr());
  const bool tiles = gemm_uses_amx();
  body(
      m, k, groups,
      [&](int64_t r, int64_t len, int64_t g, float* c) {
        for (int64_t j = 0; j < group; ++j) {
          if (tiles)
            at::native::cpublas::brgemm(len, kGemmBlockN, k, lda, kGemmBlockN, kGemmBlockN, false, a + r * lda,
                                        b + (g * group + j) * block, c + j * cblock, true);
          else
            dp_gemm(len, k, a + r * lda, lda, b + (g * group + j) * block, c + j * cblock);
        }
      },
      [&] {
        if (tiles) at::native::cpublas::brgemm_release(true);
      });
#endif
}

// Runs x [M, K] against `groups` groups of `group` consecutive column blocks of the packed weight
// (run_gemm_blocks); epilogue(row0, rows, g, c) gets the fp32 products of rows row0.. with group g,
// c[b][r][64].
template <typename Epilogue>
void run_gemm(const at::Tensor& x_in, const at::Tensor& packed, int64_t group, Epilogue&& epilogue) {
  with_gemm_kernel(x_in, packed, group, [&](int64_t m, int64_t k, int64_t groups, auto&& multiply, auto&& finish) {
    run_gemm_blocks(m, groups, group, k, multiply, epilogue, finish);
  });
}

// x [M, K] with contiguous rows and a weight packed for it: bf16 weights take bf16 x; float32
// weights take float32 x, or bf16 x (widened; the output is rounded to bf16); bf16 weights packed
// for the float32 kernel take bf16 x, or float32 x holding bf16 values (widened already: rms_norm
// and gemm_linear_silu_mul can write it so). The call's model dtype (bf16_model) is float32 only
// where both x and the weight are float32; outputs are rounded to it.
inline bool bf16_model(const at::Tensor& x, const at::Tensor& packed) {
  return x.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kBFloat16;
}

void check_gemm(const at::Tensor& x, const at::Tensor& packed, const char* name) {
  const bool f32 = f32_kernel(packed);
  TORCH_CHECK(f32 ? gemm_f32_supported() : gemm_supported(), name, ": this CPU has no ",
              f32 ? "AVX2 and FMA" : "AVX512-BF16 or AMX-BF16");
  const bool x_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x_bf16 || (f32 && x.scalar_type() == at::kFloat)) && x.stride(1) == 1 &&
                  (f32 || x.stride(0) % 2 == 0),
              name, ": x must be [M, K] with contiguous rows, bf16 (at an even stride for bf16 weights) or, for "
              "float32 weights, float32; got ", x.scalar_type());
  const bool ok = f32 ? packed.dim() == 4 && packed.is_contiguous() &&
                            packed.size(1) * kGemmPanelF32 == kGemmBlockN && packed.size(2) == x.size(1) &&
                            packed.size(3) == kGemmPanelF32
                      : packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                            packed.size(1) * 2 == x.size(1) && packed.size(2) == kGemmBlockN && packed.size(3) == 2;
  TORCH_CHECK(ok, name, ": packed must come from gemm_pack_weight for ", x.scalar_type(), " and K = ", x.size(1));
}

void gemm_linear(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  check_gemm(x, packed, "gemm_linear");
  const int64_t n = packed.size(0) * kGemmBlockN;
  check_rows(out, "out", x.size(0), n);
  const bool bf16 = bf16_model(x, packed);
  TORCH_CHECK(out.scalar_type() == (bf16 ? at::kBFloat16 : at::kFloat), "out must be ", bf16 ? "bf16" : "float32",
              " (the model dtype of x and the weight)");
  const int64_t ldo = out.stride(0);
  if (!bf16) {
    float* o = out.data_ptr<float>();
    run_gemm(x, packed, 1, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(o + (r0 + r) * ldo + g * kGemmBlockN, c + r * kGemmBlockN, kGemmBlockN * sizeof(float));
    });
    return;
  }
  if (f32_kernel(packed)) {  // a bf16 model on the float32 kernel
    auto* o = static_cast<bf16_t*>(out.data_ptr());
    run_gemm(x, packed, 1, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
      for (int64_t r = 0; r < rows; ++r) round_block_row(c + r * kGemmBlockN, o + (r0 + r) * ldo + g * kGemmBlockN);
    });
    return;
  }
#if PAGODA_GEMM_BF16
  auto* o = static_cast<bf16_t*>(out.data_ptr());
  run_gemm(x, packed, 1, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
    for (int64_t r = 0; r < rows; ++r) gemm_round_block_row(c + r * kGemmBlockN, o + (r0 + r) * ldo + g * kGemmBlockN);
  });
#endif
}

// A block row of the products as gemm_linear stores it, in the model dtype: bf16 rounded into row
// (a bf16 model) or the fp32 sums themselves (a float32 model); body gets a pointer to the values.
template <typename Body>
inline void with_stored_block_row(const float* c, bool f32, bool round_f32_kernel, Body&& body) {
  if (f32) {
    body(c);
    return;
  }
  bf16_t row[kGemmBlockN];
  if (round_f32_kernel) {
    round_block_row(c, row);
  } else {
#if PAGODA_GEMM_BF16
    gemm_round_block_row(c, row);
#endif
  }
  body(static_cast<const bf16_t*>(row));
}

#if PAGODA_EW_AVX512
inline __mmask16 lane_mask16(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
// e^x for x <= 0 (-inf gives 0; relative error ~1e-7), inline: 2^(x log2 e) as 2^n 2^f with f in
// [-0.5, 0.5] and 2^f by its Taylor series to degree 7 (Horner).
inline __m512 exp_neg_ps(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)), _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.525273380405984e-05f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381608e-04f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618129107628477e-03f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550410866482158e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.2402265069591007f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.6931471805599453f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
#endif

// Greedy sampling straight from the LM head: out[r] = argmax (first maximum, a NaN the maximum:
// argmax()'s rule) over the first `valid` columns of gemm_linear(x, packed)'s row r, without
// writing the logits. The epilogue rounds each block row as gemm_linear stores it and keeps the
// block's first maximum; the blocks' winners are then compared in column order, so the index is
// the one argmax() finds on gemm_linear's output, bit for bit.
void gemm_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t valid, at::Tensor& out) {
  check_gemm(x, packed, "gemm_linear_argmax");
  const int64_t m = x.size(0), groups = packed.size(0);
  TORCH_CHECK(valid > 0 && valid <= groups * kGemmBlockN, "gemm_linear_argmax: valid must be in [1, ",
              groups * kGemmBlockN, "], got ", valid);
  TORCH_CHECK(out.dim() == 1 && out.size(0) == m && out.scalar_type() == at::kLong && out.is_contiguous(),
              "gemm_linear_argmax: out must be a contiguous int64 [M]");
  const int64_t used = (valid + kGemmBlockN - 1) / kGemmBlockN;  // blocks with a valid column
  // Each (row, block)'s winner: its value, and its column in the block (-1: a NaN there, first NaN);
  // block-major ([used][m]), so the rows of a claim write adjacent entries.
  std::vector<float> best(m * used);
  std::vector<int8_t> where(m * used);
  const bool f32 = !bf16_model(x, packed), round_f32_kernel = !f32 && f32_kernel(packed);
  run_gemm(x, packed, 1, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
    if (g >= used) return;
    const int64_t cols = std::min(kGemmBlockN, valid - g * kGemmBlockN);
    for (int64_t r = 0; r < rows; ++r)
      with_stored_block_row(c + r * kGemmBlockN, f32, round_f32_kernel, [&](const auto* row) {
        const int64_t j = argmax_row(row, cols);
        const float v = load(row[j]);
        best[g * m + r0 + r] = v;
        where[g * m + r0 + r] = std::isnan(v) ? static_cast<int8_t>(-1 - j) : static_cast<int8_t>(j);
      });
  });
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) num_threads(threads_for(m * used))
  for (int64_t r = 0; r < m; ++r) {
    int64_t bi = 0;
    float bv = -INFINITY;
    for (int64_t g = 0; g < used; ++g) {
      const float b = best[g * m + r];
      const int8_t w = where[g * m + r];
      if (w < 0) {  // the first NaN of the row
        bi = g * kGemmBlockN + (-1 - w);
        break;
      }
      if (b > bv) {  // strict: the first block holding the maximum keeps it
        bv = b;
        bi = g * kGemmBlockN + w;
      }
    }
    o[r] = bi;
  }
}

// logprobs_rows(gemm_linear(x, packed)[:, :valid], tokens, k) without writing the logits: the
// scoring of prompt tokens (prompt_logprobs) straight from the LM head. The logits are the values
// gemm_linear stores (rounded to the model dtype); ids, ranks and the top k's values are the same
// as logprobs_rows gives on them, the logprobs the same up to the float summation order of the
// exp-sum (per 64-column block here, the blocks then added in column order: the result does not
// depend on the threads). Three phases:
//   1. each row's own token's logit, from a one-row product with its token's column block (a
//      row's products do not depend on how many rows share the call);
//   2. the GEMM, whose epilogue keeps per (row, block) the block's maximum, its exp-sum and how
//      many of its logits are above the token's, and per (thread, row) a running top k;
//   3. per row: the blocks merged in column order, the threads' top k merged.
void gemm_linear_logprobs(const at::Tensor& x, const at::Tensor& packed, int64_t valid, const at::Tensor& tokens,
                          at::Tensor& token_lp, at::Tensor& token_rank, at::Tensor& topk_ids, at::Tensor& topk_lp) {
  check_gemm(x, packed, "gemm_linear_logprobs");
  const int64_t m = x.size(0), groups = packed.size(0), k = topk_ids.dim() == 2 ? topk_ids.size(1) : -1;
  TORCH_CHECK(valid > 0 && valid <= groups * kGemmBlockN, "gemm_linear_logprobs: valid must be in [1, ",
              groups * kGemmBlockN, "], got ", valid);
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == m && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "gemm_linear_logprobs: tokens must be a contiguous int64 [", m, "]");
  TORCH_CHECK(token_lp.dim() == 1 && token_lp.size(0) == m && token_lp.scalar_type() == at::kFloat &&
                  token_lp.is_contiguous() && token_rank.dim() == 1 && token_rank.size(0) == m &&
                  token_rank.scalar_type() == at::kLong && token_rank.is_contiguous(),
              "gemm_linear_logprobs: token_lp / token_rank must be contiguous float32 / int64 [", m, "]");
  TORCH_CHECK(k >= 0 && k <= valid && topk_ids.size(0) == m && topk_ids.scalar_type() == at::kLong &&
                  topk_ids.is_contiguous() && topk_lp.dim() == 2 && topk_lp.size(0) == m && topk_lp.size(1) == k &&
                  topk_lp.scalar_type() == at::kFloat && topk_lp.is_contiguous(),
              "gemm_linear_logprobs: topk_ids / topk_lp must be contiguous int64 / float32 [", m, ", K] with K <= ",
              valid);
  const int64_t* t = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < m; ++r)
    TORCH_CHECK(t[r] >= 0 && t[r] < valid, "gemm_linear_logprobs: tokens[", r, "] is ", t[r], ", outside [0, ", valid,
                ")");
  if (m == 0) return;
  const bool f32 = !bf16_model(x, packed), round_f32_kernel = !f32 && f32_kernel(packed);
  const int64_t used = (valid + kGemmBlockN - 1) / kGemmBlockN;  // blocks with a valid column

  // 1. Each row's token's logit; rows taken in the order of their token's block, so rows sharing
  // a block find its weights in cache.
  std::vector<float> xt(m);
  std::vector<int64_t> order(m);
  for (int64_t r = 0; r < m; ++r) order[r] = r;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return t[a] / kGemmBlockN < t[b] / kGemmBlockN; });
  with_gemm_kernel(x, packed, 1, [&](int64_t, int64_t, int64_t, auto&& multiply, auto&& finish) {
#pragma omp parallel num_threads(threads_for(m * x.size(1) * kGemmBlockN))
    {
      std::vector<float> c(kGemmBlockM * kGemmBlockN);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < m; ++i) {
        const int64_t r = order[i], g = t[r] / kGemmBlockN;
        multiply(r, 1, g, c.data());
        with_stored_block_row(c.data(), f32, round_f32_kernel,
                              [&](const auto* row) { xt[r] = load(row[t[r] - g * kGemmBlockN]); });
      }
      finish();
    }
  });

  // 2. The GEMM: per (row, block) its maximum (NaN where it holds one), exp-sum and count above
  // the token's logit; per (thread, row) the top k (NaN counted as -inf, as logprobs_rows ranks it).
  std::vector<float> bmax(m * used), bsum(m * used);
  std::vector<uint8_t> above(m * used);
  const int nt = omp_get_max_threads();
  const int64_t kk = std::max<int64_t>(k, 1);
  std::vector<float> tvals(static_cast<size_t>(nt) * m * kk, -INFINITY);
  std::vector<int64_t> tids(static_cast<size_t>(nt) * m * kk, INT64_MAX);
  run_gemm(x, packed, 1, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
    if (g >= used) return;
    const int64_t cols = std::min(kGemmBlockN, valid - g * kGemmBlockN), base = g * kGemmBlockN;
    const int th = omp_get_thread_num();
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row_id = r0 + r, at = g * m + row_id;  // block-major: a claim's rows are adjacent
      with_stored_block_row(c + r * kGemmBlockN, f32, round_f32_kernel, [&](const auto* row) {
        float* vals = k ? tvals.data() + (static_cast<size_t>(th) * m + row_id) * k : nullptr;
        int64_t* ids = k ? tids.data() + (static_cast<size_t>(th) * m + row_id) * k : nullptr;
#if PAGODA_EW_AVX512
        if (cols == kGemmBlockN) {  // a whole block in four vectors
          __m512 v[4];
          for (int j = 0; j < 4; ++j) v[j] = load16(row + 16 * j);
          const __mmask16 nan = _mm512_cmp_ps_mask(v[0], v[0], _CMP_UNORD_Q) |
                                _mm512_cmp_ps_mask(v[1], v[1], _CMP_UNORD_Q) |
                                _mm512_cmp_ps_mask(v[2], v[2], _CMP_UNORD_Q) |
                                _mm512_cmp_ps_mask(v[3], v[3], _CMP_UNORD_Q);
          const float mx = nan ? NAN : _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(v[0], v[1]),
                                                                           _mm512_max_ps(v[2], v[3])));
          const __m512 vm = _mm512_set1_ps(mx), vt = _mm512_set1_ps(xt[row_id]);
          float sum = 0.f;
          int n_above = 0;
          if (mx != -INFINITY) {
            __m512 acc = exp_neg_ps(_mm512_sub_ps(v[0], vm));
            for (int j = 1; j < 4; ++j) acc = _mm512_add_ps(acc, exp_neg_ps(_mm512_sub_ps(v[j], vm)));
            sum = _mm512_reduce_add_ps(acc);
          }
          for (int j = 0; j < 4; ++j) n_above += __builtin_popcount(_mm512_cmp_ps_mask(v[j], vt, _CMP_GT_OQ));
          bmax[at] = mx;
          bsum[at] = sum;
          above[at] = static_cast<uint8_t>(n_above);
          if (k == 0) return;
          for (int j = 0; j < 4; ++j) {
            // only lanes at or above the list's last value can enter it (a NaN never does)
            __mmask16 ge = _mm512_cmp_ps_mask(v[j], _mm512_set1_ps(vals[k - 1]), _CMP_GE_OQ);
            for (; ge; ge &= ge - 1) {
              const int l = __builtin_ctz(ge);
              top_insert(load(row[16 * j + l]), base + 16 * j + l, k, vals, ids);
            }
          }
          return;
        }
#endif
        const float mx = load(row[argmax_row(row, cols)]);
        int64_t n_above = 0;
        double sum = 0.0;
        if (mx != -INFINITY) sum = exp_sum_row(row, cols, mx, xt[row_id], n_above);
        bmax[at] = mx;
        bsum[at] = sum;
        above[at] = static_cast<uint8_t>(n_above);
        for (int64_t i = 0; i < cols && k > 0; ++i) {
          const float v = load(row[i]);
          top_insert(std::isnan(v) ? -INFINITY : v, base + i, k, vals, ids);
        }
      });
    }
  });

  // 3. Per row: m = the maximum, lse = log of the exp-sum, as logprobs_rows; the top k of the
  // threads' lists.
  float* lp = token_lp.data_ptr<float>();
  int64_t* rank = token_rank.data_ptr<int64_t>();
  int64_t* out_ids = topk_ids.data_ptr<int64_t>();
  float* out_lp = topk_lp.data_ptr<float>();
  // The blocks' maxima, counts and exp-sums are block-major ([used][m]): each row's are merged in
  // column order, rows side by side.
  std::vector<float> row_max(m, -INFINITY), row_sum(m, 0.f);
  std::vector<int64_t> row_above(m, 0);
  std::vector<uint8_t> row_nan(m, 0);
  constexpr int64_t kRowChunk = 64;
#pragma omp parallel for schedule(static) num_threads(threads_for(m * used * 16))
  for (int64_t r0 = 0; r0 < m; r0 += kRowChunk) {
    const int64_t r1 = std::min(m, r0 + kRowChunk);
    float* mx = row_max.data();
    for (int64_t g = 0; g < used; ++g)
      for (int64_t r = r0; r < r1; ++r) {
        const float b = bmax[g * m + r];
        row_nan[r] |= b != b;
        mx[r] = b > mx[r] ? b : mx[r];
        row_above[r] += above[g * m + r];
      }
    float* sum = row_sum.data();
    for (int64_t g = 0; g < used; ++g) {
      const float* b = bmax.data() + g * m;
      const float* bs = bsum.data() + g * m;
#if PAGODA_EW_AVX512
      for (int64_t r = r0; r < r1; r += 16) {  // every row the same arithmetic, tail lanes masked
        const __mmask16 lanes = lane_mask16(std::min<int64_t>(16, r1 - r));
        const __m512 e = exp_neg_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, b + r), _mm512_maskz_loadu_ps(lanes, mx + r)));
        _mm512_mask_storeu_ps(sum + r, lanes, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, bs + r), e,
                                                              _mm512_maskz_loadu_ps(lanes, sum + r)));
      }
#else
      for (int64_t r = r0; r < r1; ++r) sum[r] += bs[r] * std::exp(b[r] - mx[r]);
#endif
    }
  }
#pragma omp parallel for schedule(static) num_threads(threads_for(m * nt * kk * 8))
  for (int64_t r = 0; r < m; ++r) {
    const bool nan = row_nan[r];
    const float mx = row_max[r];
    const float sum = row_sum[r];
    const int64_t n_above = row_above[r];
    const float lse = nan ? NAN : std::log(sum);
    const float m_row = nan ? NAN : mx;
    lp[r] = (xt[r] - m_row) - lse;
    rank[r] = n_above + 1;
    if (k == 0) continue;
    float* vals = out_lp + r * k;
    int64_t* ids = out_ids + r * k;
    for (int64_t j = 0; j < k; ++j) {
      vals[j] = -INFINITY;
      ids[j] = INT64_MAX;
    }
    for (int th = 0; th < nt; ++th)
      for (int64_t j = 0; j < k; ++j) {
        const size_t at = (static_cast<size_t>(th) * m + r) * k + j;
        top_insert(tvals[at], tids[at], k, vals, ids);
      }
    for (int64_t j = 0; j < k; ++j) vals[j] = (vals[j] - m_row) - lse;
  }
}

// packed: the fused gate/up weight with its 64-column blocks interleaved (gate block i at 2i, up
// block i at 2i + 1); out [M, I] = silu(gate) * up as silu_and_mul computes it from the GEMM output.
void gemm_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, at::Tensor& out) {
  check_gemm(x, packed, "gemm_linear_silu_mul");
  TORCH_CHECK(packed.size(0) % 2 == 0, "gemm_linear_silu_mul: packed must hold gate / up block pairs");
  const int64_t inter = packed.size(0) / 2 * kGemmBlockN;
  check_rows(out, "out", x.size(0), inter);
  const bool bf16 = bf16_model(x, packed);
  TORCH_CHECK(bf16 ? out.scalar_type() == at::kBFloat16 || (out.scalar_type() == at::kFloat && f32_kernel(packed))
                   : out.scalar_type() == at::kFloat,
              "out must be float32 for a float32 model; bf16 for a bf16 one (x or the weight bf16), or on the "
              "float32 kernel float32 holding its bf16 values (the down projection's input, widened already)");
  const int64_t ldo = out.stride(0);
  if (!bf16) {
    float* o = out.data_ptr<float>();
    run_gemm(x, packed, 2, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
      const float* cu = c + kGemmBlockM * kGemmBlockN;
      for (int64_t r = 0; r < rows; ++r)
        silu_mul_row(c + r * kGemmBlockN, cu + r * kGemmBlockN, o + (r0 + r) * ldo + g * kGemmBlockN, kGemmBlockN);
    });
    return;
  }
  if (f32_kernel(packed)) {  // a bf16 model on the float32 kernel: gate and up rounded to bf16 first
    const auto epilogue = [&](auto* o) {
      using O = std::remove_pointer_t<decltype(o)>;
#if PAGODA_EW_VEC
      const uint16_t* table = silu_bf16_table();  // built once, before the threads start
      // Straight from the sums: gate rounded in its lanes indexes the table, up rounded in its lanes
      // is the bf16 value as a float (silu_mul_row on the rounded rows, without storing them).
      run_gemm(x, packed, 2, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
        const float* cu = c + kGemmBlockM * kGemmBlockN;
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t j = 0; j < kGemmBlockN; j += Vec::kLanes) {
            const Vec::V s = Vec::gather_bf16(Vec::bf16_index(Vec::load(c + r * kGemmBlockN + j)), table);
            const Vec::V up = Vec::round<bf16_t>(Vec::load(cu + r * kGemmBlockN + j));
            Vec::store_in<bf16_t>(o + (r0 + r) * ldo + g * kGemmBlockN + j, Vec::mul(s, up));
          }
      });
#else
      run_gemm(x, packed, 2, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
        const float* cu = c + kGemmBlockM * kGemmBlockN;
        alignas(64) bf16_t gate[kGemmBlockN], up[kGemmBlockN];
        for (int64_t r = 0; r < rows; ++r) {
          round_block_row(c + r * kGemmBlockN, gate);
          round_block_row(cu + r * kGemmBlockN, up);
          silu_mul_row<bf16_t, O>(gate, up, o + (r0 + r) * ldo + g * kGemmBlockN, kGemmBlockN);
        }
      });
#endif
    };
    if (out.scalar_type() == at::kFloat)
      epilogue(out.data_ptr<float>());
    else
      epilogue(static_cast<bf16_t*>(out.data_ptr()));
    return;
  }
#if PAGODA_GEMM_BF16
  const uint16_t* table = silu_bf16_table();
  auto* o = static_cast<bf16_t*>(out.data_ptr());
  run_gemm(x, packed, 2, [&](int64_t r0, int64_t rows, int64_t g, const float* c) {
    const float* cu = c + kGemmBlockM * kGemmBlockN;
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < kGemmBlockN; j += 16) {
        const __m512i idx = _mm512_cvtepu16_epi32(gemm_round16(c + r * kGemmBlockN + j));
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(idx, table, 2), 16));
        store16(o + (r0 + r) * ldo + g * kGemmBlockN + j,
                _mm512_mul_ps(s, bits_to_f32(gemm_round16(cu + r * kGemmBlockN + j))));
      }
  });
#endif
}

// The epilogue of gemm_linear_rotary_to_cache for rows r0.. of head block h: each row's 64 outputs
// (in T, as gemm_linear stores them: to_row) go through rotary to q, or to the key cache, or
// unrotated to the value cache.
// C: the caches' element, T or a one-byte code type (rotary(k) through a row buffer, cache_row).
template <typename T, typename ToRow, typename C = T>
void rotary_to_cache_rows(int64_t r0, int64_t rows, int64_t h, const float* c, ToRow&& to_row, T* q, C* kc, C* vc,
                          int64_t heads, int64_t kv_heads, const int64_t* slots, int64_t cached, const int64_t* pos,
                          const float* ct, const float* st) {
  constexpr int64_t dim = kGemmBlockN;
  const int64_t kv_row = kv_heads * dim;
  alignas(64) T row[kGemmBlockN];
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = r0 + i;
    const bool kv = h >= heads;
    if (kv && r >= cached) continue;  // GEMM padding rows: q only
    to_row(c + i * kGemmBlockN, row);
    if (h >= heads + kv_heads) {
      cache_head(row, vc, slots[r], h - heads - kv_heads, kv_heads, dim);
      continue;
    }
    const RowRotator<T> rot(ct + pos[r] * dim, st + pos[r] * dim, dim);
    if (!kv) {
      rot.apply(row, q + (r * heads + h) * dim, 1);
    } else if constexpr (std::is_same_v<C, T>) {
      rot.apply(row, kc + slots[r] * kv_row + (h - heads) * dim, 1);
    } else {
      alignas(64) T k[kGemmBlockN];
      rot.apply(row, k, 1);
      cache_head(k, kc, slots[r], h - heads, kv_heads, dim);
    }
  }
}

// packed: the fused QKV weight (q heads, k heads, v heads; head_dim 64, one block per head). As
// rotary_qkv_to_cache on gemm_linear's output: q_out [M, H, 64] = rotary(q); rows r < len(slots)
// also get rotary(k) and v written to their cache slots.
void gemm_linear_rotary_to_cache(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& positions,
                                 const at::Tensor& cos_table, const at::Tensor& sin_table, at::Tensor& q_out,
                                 at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_gemm(x, packed, "gemm_linear_rotary_to_cache");
  const int64_t m = x.size(0), heads = q_out.size(1), dim = kGemmBlockN;
  const auto dtype = bf16_model(x, packed) ? at::kBFloat16 : at::kFloat;  // of q_out and the caches
  TORCH_CHECK(key_cache.dim() == 4 && cache_head_dim(key_cache) == dim && key_cache.is_contiguous() &&
                  value_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                  cache_takes(key_cache.scalar_type(), dtype) && value_cache.scalar_type() == key_cache.scalar_type(),
              "caches must be contiguous [num_blocks, block_size, kv_heads, 64] alike, in the model dtype (or "
              "float8_e5m2 / float8_e4m3fn; or int8 [..., 68]: codes and a scale a row)");
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(packed.size(0) == heads + 2 * kv_heads, "packed must hold ", heads + 2 * kv_heads, " head blocks");
  TORCH_CHECK(q_out.dim() == 3 && q_out.size(0) == m && q_out.size(2) == dim && q_out.is_contiguous() &&
                  q_out.scalar_type() == dtype, "q_out must be contiguous [M, H, 64] in the model dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == m && positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(), "positions must be contiguous int64 [M]");
  TORCH_CHECK(cos_table.scalar_type() == at::kFloat && sin_table.scalar_type() == at::kFloat &&
                  cos_table.is_contiguous() && sin_table.is_contiguous() && cos_table.size(1) == dim &&
                  sin_table.sizes() == cos_table.sizes(), "cos / sin tables must be contiguous float32 [P, 64]");
  const int64_t cached = slot_mapping.size(0), num_slots = key_cache.size(0) * key_cache.size(1);
  TORCH_CHECK(slot_mapping.dim() == 1 && cached <= m && slot_mapping.scalar_type() == at::kLong &&
                  slot_mapping.is_contiguous(), "slot_mapping must be contiguous int64 [<= M]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < cached; ++r)
    TORCH_CHECK(slots[r] >= 0 && slots[r] < num_slots, "slot ", slots[r], " outside the cache [0, ", num_slots, ")");
  for (int64_t r = 0; r < m; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos_table.size(0), "position ", pos[r], " outside the rotary table");
  const float* ct = cos_table.data_ptr<float>();
  const float* st = sin_table.data_ptr<float>();
  // Rows in the model dtype E, as gemm_linear stores them (to_row), into an E or a one-byte cache.
  const auto rows_to_cache = [&](auto* q, auto&& to_row) {
    using E = std::remove_pointer_t<decltype(q)>;
    with_cache_element<E>(key_cache.scalar_type(), [&](E*, auto* elem) {
      using C = std::remove_pointer_t<decltype(elem)>;
      auto* kc = static_cast<C*>(key_cache.data_ptr());
      auto* vc = static_cast<C*>(value_cache.data_ptr());
      run_gemm(x, packed, 1, [&](int64_t r0, int64_t rows, int64_t h, const float* c) {
        rotary_to_cache_rows(r0, rows, h, c, to_row, q, kc, vc, heads, kv_heads, slots, cached, pos, ct, st);
      });
    });
  };
  if (dtype == at::kFloat) {
    rows_to_cache(q_out.data_ptr<float>(),
                  [](const float* c, float* row) { std::memcpy(row, c, kGemmBlockN * sizeof(float)); });
    return;
  }
  auto* q = static_cast<bf16_t*>(q_out.data_ptr());
  if (f32_kernel(packed)) {  // a bf16 model on the float32 kernel
    rows_to_cache(q, round_block_row);
    return;
  }
#if PAGODA_GEMM_BF16
  rows_to_cache(q, gemm_round_block_row);
#endif
}

// ---- the decoder layers in one call ------------------------------------------------------------
//
// decoder_layers runs LlamaDecoderLayer.forward for a stack of layers (engine_service/models/llama.py
// has the same steps in Python; both call the kernels above and those of paged_attention_cpu.cpp, so
// they agree bit for bit). In Python a layer is ~25 calls between kernels, and each runs cold: the
// kernel before it has pushed the interpreter's data out of the caches (measured on the shared
// workload, 2-core Xeon: 2.8 ms a forward at 16 rows, 5.2 ms at 256, 10-19 ms at 2048, against
// 0.9 ms for the same Python with warm caches). Here a layer's glue is a few tensor headers.

// x [M, K] @ W.T through oneDNN, on a weight blocked by torch.ops.mkldnn._reorder_linear_weight
// (what LlamaForCausalLM's packed Linear calls: torch.ops.mkldnn._linear_pointwise). A weight wider
// than x (a bf16 model on a CPU without bf16 dot products keeps float32 weights) multiplies x
// widened and the output is rounded back to x's dtype, as llama.py's linear() does.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& weight) {
  if (weight.scalar_type() != x.scalar_type())
    return onednn_linear(x.to(weight.scalar_type()), weight).to(x.scalar_type());
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, weight, c10::IValue(), c10::IValue("none"),
                          c10::IValue(c10::List<std::optional<at::Scalar>>()), c10::IValue("")};
  op.callBoxed(&stack);
  return std::move(stack[0]).toTensor();
}

inline bool given(const at::Tensor& t) { return t.defined() && t.numel() > 0; }

// A projection: ours (gemm, into out) at up to gemm_rows rows, else oneDNN's (a new tensor).
at::Tensor project(const at::Tensor& x, const at::Tensor& gemm, const at::Tensor& onednn, bool gemm_rows,
                   at::Tensor& out) {
  if (given(gemm) && gemm_rows) {
    gemm_linear(x, gemm, out);
    return out;
  }
  TORCH_CHECK(given(onednn), "decoder_layers: a projection has no weight for ", x.size(0), " rows");
  return onednn_linear(x, onednn);
}

constexpr int64_t kLayerWeights = 10;

// h [T, hidden] (the embeddings, or the previous layers' MLP output with its residual stream
// `residual`) through the layers whose weights are listed, kLayerWeights a layer: input norm,
// post-attention norm, then for QKV, o_proj, gate/up and down_proj the gemm_pack_weight layout
// (gate/up interleaved) and oneDNN's; an empty tensor where the layer has none (each projection
// needs one; ours runs at up to gemm_max_rows rows, -1: any, and gate/up at any). kv_caches: the
// layers' key and value caches. Rows past len(slot_mapping) are GEMM padding (no K/V, no
// attention, zeros into o_proj); the first num_decode rows decode, the rest are prefill chunks.
// Returns (the last layer's MLP output, the residual stream before it), like the Python layers.
std::tuple<at::Tensor, at::Tensor> decoder_layers(
    const at::Tensor& input, const std::optional<at::Tensor>& residual_in, at::TensorList weights, at::TensorList kv_caches,
    const at::Tensor& positions, const at::Tensor& cos_table, const at::Tensor& sin_table,
    const at::Tensor& slot_mapping, int64_t num_decode, const at::Tensor& decode_block_tables,
    const at::Tensor& decode_seq_lens, const at::Tensor& prefill_block_tables, const at::Tensor& prefill_query_start,
    const at::Tensor& prefill_seq_lens, int64_t num_heads, double eps, double scale, int64_t gemm_max_rows) {
  const int64_t layers = static_cast<int64_t>(weights.size()) / kLayerWeights;
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * kLayerWeights &&
                  static_cast<int64_t>(kv_caches.size()) == 2 * layers,
              "decoder_layers: ", kLayerWeights, " weights and 2 caches a layer expected, got ", weights.size(),
              " and ", kv_caches.size());
  TORCH_CHECK(input.dim() == 2 && input.is_contiguous(), "decoder_layers: h must be contiguous [T, hidden]");
  at::Tensor h = input;
  const int64_t t = h.size(0), tr = slot_mapping.size(0);
  TORCH_CHECK(tr <= t && num_decode >= 0 && num_decode <= tr, "decoder_layers: num_decode ", num_decode,
              ", ", tr, " cached rows and ", t, " rows are inconsistent");
  at::Tensor residual = residual_in ? *residual_in : h;
  if (layers == 0) return {h, residual};
  const int64_t head_dim = cache_head_dim(kv_caches[0]);
  const bool gemm_rows = gemm_max_rows < 0 || t <= gemm_max_rows;
  const int threads = at::get_num_threads();
  // A bf16 model whose QKV, gate/up and down weights are bf16 on the float32 kernel: the RMSNorm and
  // silu * up outputs, which only those GEMMs read, go to float32 buffers holding their bf16 values,
  // so the GEMMs do not widen them in passes of their own (bitwise the same).
  bool widened = gemm_rows && h.scalar_type() == at::kBFloat16;
  for (int64_t i = 0; i < layers && widened; ++i)
    for (const int64_t j : {2, 6, 8}) {
      const at::Tensor& wj = weights[i * kLayerWeights + j];
      widened = widened && given(wj) && wj.scalar_type() == at::kBFloat16 && f32_kernel(wj);
    }
  const auto act_options = widened ? h.options().dtype(at::kFloat) : h.options();
  // One buffer per activation for all the layers (oneDNN's projections return their own).
  at::Tensor x = at::empty(h.sizes(), act_options), o = at::empty(h.sizes(), h.options());
  at::Tensor down = at::empty(h.sizes(), h.options());
  at::Tensor q = at::empty({t, num_heads, head_dim}, h.options()), attn = at::empty(q.sizes(), q.options());
  at::Tensor attn2d = attn.view({t, num_heads * head_dim});
  at::Tensor q_dec = q.narrow(0, 0, num_decode), attn_dec = attn.narrow(0, 0, num_decode);
  at::Tensor q_pre = q.narrow(0, num_decode, tr - num_decode), attn_pre = attn.narrow(0, num_decode, tr - num_decode);
  at::Tensor act, qkv_out;  // the MLP's silu(gate) * up; our QKV GEMM's output (head_dim other than 64)
  if (tr < t)  // the padding rows' attention output: zeros for o_proj, as the Python layer writes
    std::memset(static_cast<char*>(attn.data_ptr()) + tr * attn2d.size(1) * attn.element_size(), 0,
                (t - tr) * attn2d.size(1) * attn.element_size());
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = &weights[i * kLayerWeights];
    at::Tensor kc = kv_caches[2 * i], vc = kv_caches[2 * i + 1];
    if (i == 0 && !residual_in)
      rms_norm(h, std::nullopt, w[0], eps, x);
    else
      rms_norm(h, residual, w[0], eps, x);
    if (given(w[2]) && gemm_rows && head_dim == kGemmBlockN) {
      gemm_linear_rotary_to_cache(x, w[2], positions, cos_table, sin_table, q, kc, vc, slot_mapping);
    } else {
      if (given(w[2]) && gemm_rows && !qkv_out.defined())
        qkv_out = at::empty({t, w[2].size(0) * kGemmBlockN}, h.options());
      const at::Tensor qkv = project(x, w[2], w[3], gemm_rows, qkv_out);
      rotary_qkv_to_cache(qkv, positions, cos_table, sin_table, q, kc, vc, slot_mapping);
    }
    if (num_decode > 0)
      pagoda::decode_attention(q_dec, kc, vc, decode_block_tables, decode_seq_lens, scale, attn_dec, threads);
    if (num_decode < tr)
      pagoda::prefill_attention(q_pre, kc, vc, prefill_block_tables, prefill_query_start, prefill_seq_lens, scale,
                                attn_pre, threads);
    const at::Tensor proj = project(attn2d, w[4], w[5], gemm_rows, o);
    rms_norm(proj, residual, w[1], eps, x);
    if (given(w[6])) {
      if (!act.defined()) act = at::empty({t, w[6].size(0) / 2 * kGemmBlockN}, act_options);
      gemm_linear_silu_mul(x, w[6], act);
    } else {
      TORCH_CHECK(given(w[7]), "decoder_layers: layer ", i, " has no gate/up weight");
      const at::Tensor gate_up = onednn_linear(x, w[7]);
      if (!act.defined()) act = at::empty({t, gate_up.size(1) / 2}, h.options());
      silu_and_mul(gate_up, act);
    }
    h = project(act, w[8], w[9], gemm_rows, down);
  }
  return {h, residual};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagoda_cpu, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()");
  m.impl("reshape_and_cache", c10::DispatchKey::CPU, TORCH_FN(reshape_and_cache));
  m.def("rms_norm(Tensor x, Tensor(b!)? residual, Tensor weight, float eps, Tensor(a!) out) -> ()");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.def("rotary_embedding(Tensor x, Tensor positions, Tensor cos_table, Tensor sin_table, Tensor(a!) out) -> ()");
  m.impl("rotary_embedding", c10::DispatchKey::CPU, TORCH_FN(rotary_embedding));
  m.def("rotary_qkv_to_cache(Tensor qkv, Tensor positions, Tensor cos_table, Tensor sin_table, Tensor(a!) q_out, "
        "Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping) -> ()");
  m.impl("rotary_qkv_to_cache", c10::DispatchKey::CPU, TORCH_FN(rotary_qkv_to_cache));
  m.def("silu_and_mul(Tensor gate_up, Tensor(a!) out) -> ()");
  m.impl("silu_and_mul", c10::DispatchKey::CPU, TORCH_FN(silu_and_mul));
  m.def("argmax(Tensor x, Tensor(a!) out) -> ()");
  m.impl("argmax", c10::DispatchKey::CPU, TORCH_FN(argmax));
  m.def("sample_rows(Tensor x, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniform, "
        "Tensor? penalties, Tensor? prompt_ids, Tensor? prompt_starts, Tensor? output_ids, Tensor? output_starts, "
        "Tensor? banned_ids, Tensor? banned_starts, Tensor(a!) out) -> ()");
  m.impl("sample_rows", c10::DispatchKey::CPU, TORCH_FN(sample_rows));
  m.def("logprobs_rows(Tensor x, Tensor tokens, Tensor(a!) token_lp, Tensor(b!) token_rank, Tensor(c!) topk_ids, "
        "Tensor(d!) topk_lp) -> ()");
  m.impl("logprobs_rows", c10::DispatchKey::CPU, TORCH_FN(logprobs_rows));
  m.def("gemm_supported() -> bool", TORCH_FN(gemm_supported));
  m.def("gemm_uses_amx() -> bool", TORCH_FN(gemm_uses_amx));
  m.def("gemm_f32_supported() -> bool", TORCH_FN(gemm_f32_supported));
  m.def("gemm_pack_weight(Tensor weight, bool float32_kernel=False) -> Tensor");
  m.impl("gemm_pack_weight", c10::DispatchKey::CPU, TORCH_FN(gemm_pack_weight));
  m.def("gemm_test_stall(int thread, int microseconds) -> ()", TORCH_FN(gemm_test_stall));
  m.def("gemm_steals() -> int", TORCH_FN(gemm_steals));
  m.def("gemm_trace(bool on) -> Tensor", TORCH_FN(gemm_trace));
  m.def("gemm_tsc() -> int", TORCH_FN(gemm_tsc));
  m.def("gemm_set_nta_rows(int rows) -> int", TORCH_FN(gemm_set_nta_rows));
  m.def("gemm_linear(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
  m.impl("gemm_linear", c10::DispatchKey::CPU, TORCH_FN(gemm_linear));
  m.def("gemm_linear_argmax(Tensor x, Tensor packed, int valid, Tensor(a!) out) -> ()");
  m.impl("gemm_linear_argmax", c10::DispatchKey::CPU, TORCH_FN(gemm_linear_argmax));
  m.def("gemm_linear_logprobs(Tensor x, Tensor packed, int valid, Tensor tokens, Tensor(a!) token_lp, "
        "Tensor(b!) token_rank, Tensor(c!) topk_ids, Tensor(d!) topk_lp) -> ()");
  m.impl("gemm_linear_logprobs", c10::DispatchKey::CPU, TORCH_FN(gemm_linear_logprobs));
  m.def("gemm_linear_silu_mul(Tensor x, Tensor packed, Tensor(a!) out) -> ()");
  m.impl("gemm_linear_silu_mul", c10::DispatchKey::CPU, TORCH_FN(gemm_linear_silu_mul));
  m.def("gemm_linear_rotary_to_cache(Tensor x, Tensor packed, Tensor positions, Tensor cos_table, Tensor sin_table, "
        "Tensor(a!) q_out, Tensor(b!) key_cache, Tensor(c!) value_cache, Tensor slot_mapping) -> ()");
  m.impl("gemm_linear_rotary_to_cache", c10::DispatchKey::CPU, TORCH_FN(gemm_linear_rotary_to_cache));
  m.def("decoder_layers(Tensor(a!) h, Tensor(b!)? residual, Tensor[] weights, Tensor(c!)[] kv_caches, "
        "Tensor positions, Tensor cos_table, Tensor sin_table, Tensor slot_mapping, int num_decode, "
        "Tensor decode_block_tables, Tensor decode_seq_lens, Tensor prefill_block_tables, "
        "Tensor prefill_query_start, Tensor prefill_seq_lens, int num_heads, float eps, float scale, "
        "int gemm_max_rows) -> (Tensor, Tensor)");
  m.impl("decoder_layers", c10::DispatchKey::CPU, TORCH_FN(decoder_layers));
  // The oneDNN-blocked weights are MkldnnCPU tensors: the call dispatches there when any is passed.
  m.impl("decoder_layers", c10::DispatchKey::MkldnnCPU, TORCH_FN(decoder_layers));
}
