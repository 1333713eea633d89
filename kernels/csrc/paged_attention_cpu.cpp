// Paged attention for the CPU: DECODE and PREFILL / chunked prefill, reading K/V straight through
// the block table (no gather).
//
// Layout (per layer): key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim]
// (the last dim must be contiguous; the other strides are free), block_tables [B, max_blocks]
// int32 (rows may be strided). An int8 cache's last dim is head_dim + 4: each row's codes, then its
// float32 scale (pagoda_cpu.h, i8s_t; read where one-byte caches are).
//
// Decode (q / out [B, H, D] contiguous, seq_lens [B] int32): work is split into items (sequence,
// all kv heads or one[, context slice]) claimed in order by the threads (a dynamic schedule), longest first. An
// item walks its sequence's tokens in spans of 32 (16 when many heads share a pass) and processes
// the g = H / kvh query heads sharing a kv head together, so each K/V row is loaded from memory once
// for all of them; the scores read each token's K rows of all the item's kv heads in one go (address
// order). Online softmax (running max / sum), fp32 accumulators; bf16 uses vdpbf16ps for Q K^T and,
// with P rounded to bf16, for P V (SmolLM2's shapes: two tokens a score vector, all of a V row's
// chunks in one walk over the span); on an int8 cache, integer dot products on the codes instead
// (vpdpbusd against two int8 digits of each query, vpdpwssd against P in 15 bits). Blocks sit at random places, out of reach of the hardware
// prefetchers, so each kv head's pass requests into L2 its part of the K and V rows a span or more
// (~24 KB) ahead, one row per token of arithmetic, and on into the first rows of the item its thread
// runs next (items are claimed one ahead). A context longer than a slice (2048 / threads
// tokens, at least 256) is split into block-aligned slices (flash-decoding) whose partial results
// are merged at the end; the slice size never depends on the batch, so neither does a row's
// result. Consecutive rows that are one sequence's consecutive positions (a speculative step's
// verified tokens) run as one item: each span's K/V rows are read from memory once for all of
// them, and each row gets the bits it would get alone (group_rows, run_item).
//
// Prefill (q / out [T, H, D], head_dim contiguous, the chunks back to back; query_start_loc
// [Bp + 1] and seq_lens [Bp] int32): query i of a chunk of length L in a sequence of length S sees
// keys 0 .. S - L + i (bottom-right-aligned causal mask); all keys, the chunk's own included, are
// read from the cache (the layer writes them before attending). Work items are (sequence, kv head,
// query tile); a query tile holds the g q heads of its kv head for a run of tokens (rows = tokens x
// g), so every K/V tile loaded serves all of them. Per 64-key tile the item packs K (transposed:
// pairs of head_dim x keys) and V (pairs of keys interleaved), then runs register-blocked panels of
// 6 query rows: scores with vdpbf16ps (bf16) or FMAs (fp32), online softmax, P @ V. On CPUs with
// AMX-BF16 (Sapphire Rapids and later), bf16 panels are 16 rows and both products run on tiles
// (prefill_panel_amx): 2.9-3.4x the vector panels on SmolLM2 shapes. On AVX2-only CPUs the panels
// run in fp32 on 8-lane vectors (bf16 widened as it is packed), scores parked in L1 between the
// products and the softmax.
//
// Built at first use by pagoda_kernels/cpu_attention.py with -O3 -march=native -fopenmp. Only
// light torch headers are included (no pybind11, no ATen operators) so the build takes seconds.
// The AVX-512 path is used when the compiler targets it, else the AVX2 + FMA one; without either,
// decode runs a portable 16-lane fallback that gcc auto-vectorizes for whatever the target offers,
// and prefill is unavailable (the Python side then uses torch).

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "pagoda_cpu.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PAGODA_AVX512 1
#define PAGODA_AVX2 0
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define PAGODA_AVX512 0
#define PAGODA_AVX2 1
#else
#define PAGODA_AVX512 0
#define PAGODA_AVX2 0
#endif

namespace {

constexpr int kTile = 16;    // tokens per decode tile == lanes per vector
constexpr int kMaxNH = 8;    // query heads processed together per pass over a tile
constexpr int kPrefetchBytes = 24 << 10;  // decode: software prefetch distance (K+V bytes of an item)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// 2^r = e^(r ln2) on [-0.5, 0.5]: Taylor to degree 7, highest power first (rel. error ~5e-9); the
// vector exp2_ps of each instruction set evaluates it by Horner's rule.
constexpr float kExp2Poly[8] = {1.5252733804059841e-05f, 1.5403530393381606e-04f, 1.3333558146428441e-03f,
                                9.6181291076284772e-03f, 5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                6.9314718055994531e-01f, 1.0f};

// Storage tags for the 16-bit types (raw bits).
using pagoda::bf16_t;
struct f16_t { uint16_t x; };
// One-byte K/V cache elements (pagoda_cpu.h), read by the bf16 decode kernel where it has vdpbf16ps
// (f8_words), and on AVX2 builds widened to float32 exactly through F16C (vload).
using pagoda::f8e4m3_t;
using pagoda::f8e5m2_t;
using pagoda::f8_kind;
using pagoda::kE4M3;
using pagoda::kE5M2;
using pagoda::i8s_t;
using pagoda::kI8;
using pagoda::kNoF8;
using pagoda::one_byte_dtype;
// A cache element of kind F8 for queries of T's.
template <typename T, int F8>
using CacheElem = std::conditional_t<
    F8 == kE5M2, f8e5m2_t, std::conditional_t<F8 == kE4M3, f8e4m3_t, std::conditional_t<F8 == kI8, i8s_t, T>>>;

inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) { return pagoda::bf16_to_float(v); }
inline float to_float(f16_t v) { return static_cast<float>(c10::Half(v.x, c10::Half::from_bits())); }

inline void from_float(float f, float* dst) { *dst = f; }
inline void from_float(float f, bf16_t* dst) { *dst = pagoda::float_to_bf16(f); }
inline void from_float(float f, f16_t* dst) { dst->x = c10::Half(f).x; }

// ------------------------------------------------------------------------------------------
// 16-lane float vector: AVX-512, AVX2 or portable.
// ------------------------------------------------------------------------------------------
#if PAGODA_AVX512

struct V16 {
  __m512 v;
};
inline V16 vzero() { return {_mm512_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm512_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 vload(const bf16_t* p) {
  __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(w, 16))};
}
inline V16 vload(const f16_t* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
// 16 one-byte codes as float16 words widened (the float32 path: float32 queries): an e5m2 code << 8
// is the float16 of its value; an e4m3 code << 8, shifted right by one (arithmetic) with bit 14
// cleared, is the float16 of its value times 2^-8 (vload takes it back, below the ISA sections).
inline __m256i codes_hi16(const void* p) {
  return _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(static_cast<const __m128i*>(p))), 8);
}
inline V16 vload(const f8e5m2_t* p) { return {_mm512_cvtph_ps(codes_hi16(p))}; }
// 16 int8 codes as floats, exactly (an int8 cache's rows before their scale).
inline V16 vload(const i8s_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline V16 vload_e4m3_scaled(const f8e4m3_t* p) {  // the values times 2^-8
  const __m256i h =
      _mm256_and_si256(_mm256_srai_epi16(codes_hi16(p), 1), _mm256_set1_epi16(static_cast<short>(0xBF80)));
  return {_mm512_cvtph_ps(h)};
}
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float vreduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline float vreduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline __mmask16 lane_mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
// Lanes >= n become -inf.
inline V16 vmask_ninf(V16 a, int n) { return {_mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), lane_mask(n), a.v)}; }
// 2^x for x <= 0 (x = -inf allowed; gives 2^-127 there, callers mask).
inline __m512 exp2_ps(__m512 a) {
  __m512 x = _mm512_max_ps(a, _mm512_set1_ps(-127.f));
  __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, k);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, k);
}
// 2^x for x <= 0 (x = -inf allowed; lanes >= n forced to 0).
inline V16 vexp2_masked(V16 a, int n) { return {_mm512_maskz_mov_ps(lane_mask(n), exp2_ps(a.v))}; }
// The last three levels of the transpose-and-add trees below: eight vectors, each holding two
// tokens' 8-lane partial sums in its 256-bit halves, to one vector of 16 sums (7 adds + 14 shuffles).
// Vector i's halves end up in lanes (chunk by chunk) as the callers' permutations undo.
inline __attribute__((always_inline)) __m512 hsum_halves(const __m512* a) {
  __m512 b[4], d[2];
  for (int i = 0; i < 4; ++i)  // 128-bit chunks: a[i]'s low half, its high half, a[i + 4]'s low, high
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i], a[i + 4], 0x88), _mm512_shuffle_f32x4(a[i], a[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(b[i], b[i + 2], 0x44), _mm512_shuffle_ps(b[i], b[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}
// out lane t = sum of the 16 lanes of a[t] (the first level folds each pair a[i], a[i + 8] to
// one vector: low 256 bits token i, high token i + 8; then hsum_halves).
inline __attribute__((always_inline)) V16 hsum16(const V16* a) {
  __m512 b[8];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i].v, a[i + 8].v, 0x44),
                         _mm512_shuffle_f32x4(a[i].v, a[i + 8].v, 0xEE));
  // hsum_halves leaves tokens in lane order 0,2,1,3,8,10,9,11,4,6,5,7,12,14,13,15 (an involution).
  const __m512i idx = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return {_mm512_permutexvar_ps(idx, hsum_halves(b))};
}
// out lane t = sum of the 8 lanes of token t, where a[i] holds token 2i in its low 256 bits and
// token 2i + 1 in its high ones (span_scores' paired tokens): hsum16 without its first level.
inline __attribute__((always_inline)) V16 hsum_pairs(const V16* a) {
  const __m512 b[8] = {a[0].v, a[1].v, a[2].v, a[3].v, a[4].v, a[5].v, a[6].v, a[7].v};
  // hsum_halves leaves tokens in lane order 0,4,2,6,1,5,3,7,8,12,10,14,9,13,11,15 (an involution).
  const __m512i idx = _mm512_setr_epi32(0, 4, 2, 6, 1, 5, 3, 7, 8, 12, 10, 14, 9, 13, 11, 15);
  return {_mm512_permutexvar_ps(idx, hsum_halves(b))};
}
// Inline asm rather than _mm_prefetch / __builtin_prefetch: gcc 12 deleted every prefetch of the
// row loops below once inlined (no prefetch instruction left in the binary).
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

#elif PAGODA_AVX2
// Two 8-lane halves (AVX2 + FMA + F16C: Zen 1-3, Intel before Skylake-SP). Lane i of the 16 is
// lane i of lo for i < 8, lane i - 8 of hi otherwise.

struct V16 {
  __m256 lo, hi;
};
inline V16 vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline V16 vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline __m256 bf16x8_to_ps(const bf16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline V16 vload(const bf16_t* p) { return {bf16x8_to_ps(p), bf16x8_to_ps(p + 8)}; }
inline V16 vload(const f16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
// 16 e5m2 codes, exactly: interleaved below zero bytes, each code becomes the float16 code << 8,
// which holds the code's value (subnormals, infinities and NaNs included).
inline V16 vload(const f8e5m2_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b)),
          _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), b))};
}
// 16 e4m3 codes: code << 8 shifted right by one (arithmetic) and bit 14 cleared puts the sign, 4
// exponent and 3 mantissa bits in a float16's places: the code's value times 2^-8, subnormals
// included (the NaN code reads as 480), widened exactly (vload takes the 2^-8 back).
inline __attribute__((always_inline)) __m256 e4m3x8_to_ps_scaled(__m128i code_hi) {
  const __m128i h = _mm_and_si128(_mm_srai_epi16(code_hi, 1), _mm_set1_epi16(static_cast<short>(0xBF80)));
  return _mm256_cvtph_ps(h);
}
// 16 int8 codes as floats, exactly (an int8 cache's rows before their scale).
inline V16 vload(const i8s_t* p) {
  const auto* b = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(b))),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline V16 vload_e4m3_scaled(const f8e4m3_t* p) {  // the values times 2^-8
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {e4m3x8_to_ps_scaled(_mm_unpacklo_epi8(_mm_setzero_si128(), b)),
          e4m3x8_to_ps_scaled(_mm_unpackhi_epi8(_mm_setzero_si128(), b))};
}
inline void vstore(float* p, V16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 vadd(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline float hmax8(__m256 a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}
inline float vreduce_max(V16 a) { return hmax8(_mm256_max_ps(a.lo, a.hi)); }
inline float vreduce_add(V16 a) {
  const __m256 s8 = _mm256_add_ps(a.lo, a.hi);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
// Lanes < n of each half (n may be <= 0 or >= 8).
inline __m256 half_mask(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
// Lanes >= n become -inf.
inline V16 vmask_ninf(V16 a, int n) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  return {_mm256_blendv_ps(ninf, a.lo, half_mask(n)), _mm256_blendv_ps(ninf, a.hi, half_mask(n - 8))};
}
// 2^x for x <= 0 (x = -inf allowed; gives 0 below 2^-126, where callers mask anyway).
inline __m256 exp2_ps(__m256 a) {
  const __m256 x = _mm256_max_ps(a, _mm256_set1_ps(-127.f));
  const __m256 k = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(x, k);  // [-0.5, 0.5]
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExp2Poly[i]));
  // 2^k as a float: k + 127 in the exponent field (k = -127 gives +0).
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
// 2^x for x <= 0 (x = -inf allowed; lanes >= n forced to 0).
inline V16 vexp2_masked(V16 a, int n) {
  return {_mm256_and_ps(half_mask(n), exp2_ps(a.lo)), _mm256_and_ps(half_mask(n - 8), exp2_ps(a.hi))};
}
// Lane t of the result = sum of the 8 lanes of a[t], t < 8.
inline __m256 hsum8x8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 h0123 = _mm256_hadd_ps(h01, h23), h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}
// out lane t = sum of the 16 lanes of a[t].
inline __attribute__((always_inline)) V16 hsum16(const V16* a) {
  __m256 s[16];
  for (int t = 0; t < 16; ++t) s[t] = _mm256_add_ps(a[t].lo, a[t].hi);
  return {hsum8x8(s), hsum8x8(s + 8)};
}
// Inline asm for the reason given in the AVX-512 branch.
inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p))); }
inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p))); }

#else  // portable fallback

struct V16 {
  float v[16];
};
inline V16 vzero() {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = 0.f;
  return r;
}
inline V16 vset1(float x) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
template <typename T>
inline V16 vload(const T* p) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = to_float(p[i]);
  return r;
}
inline void vstore(float* p, V16 a) {
  for (int i = 0; i < 16; ++i) p[i] = a.v[i];
}
inline V16 vfma(V16 a, V16 b, V16 c) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i] + c.v[i];
  return r;
}
inline V16 vmul(V16 a, V16 b) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] * b.v[i];
  return r;
}
inline V16 vadd(V16 a, V16 b) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = a.v[i] + b.v[i];
  return r;
}
inline float vreduce_max(V16 a) {
  float m = a.v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, a.v[i]);
  return m;
}
inline float vreduce_add(V16 a) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a.v[i];
  return s;
}
inline V16 vmask_ninf(V16 a, int n) {
  for (int i = n; i < 16; ++i) a.v[i] = kNegInf;
  return a;
}
inline V16 vexp2_masked(V16 a, int n) {
  V16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = i < n ? std::exp2(a.v[i]) : 0.f;
  return r;
}
inline V16 hsum16(const V16* a) {
  V16 r;
  for (int t = 0; t < 16; ++t) r.v[t] = vreduce_add(a[t]);
  return r;
}
inline void prefetch_l1(const void* p) { __builtin_prefetch(p, 0, 3); }
inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

#endif

// (Every CPU with AVX512-BF16 has AVX512-VNNI too, which an int8 cache's scores use: Cooper Lake,
// Sapphire Rapids and later, Zen 4 and later.)
#if PAGODA_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PAGODA_DPBF16 1
#else
#define PAGODA_DPBF16 0
#endif

#if PAGODA_AVX512 || PAGODA_AVX2
#define PAGODA_INLINE inline __attribute__((always_inline))
#else
#define PAGODA_INLINE inline
#endif

#if PAGODA_AVX512 || PAGODA_AVX2
// 16 e4m3 codes, exactly (vload_e4m3_scaled's values times 2^8).
inline V16 vload(const f8e4m3_t* p) { return vmul(vload_e4m3_scaled(p), vset1(256.f)); }
// n codes (a multiple of 16) -> their values as float32: a float32 model's prefill rows.
template <typename CT>
inline void f8_values_row(const CT* src, float* dst, int n) {
  for (int i = 0; i < n; i += 16) vstore(dst + i, vload(src + i));
}
// An int8 cache's row of n codes and its scale -> float32(code x scale).
inline void f8_values_row(const i8s_t* src, float* dst, int n) {
  const V16 scale = vset1(pagoda::row_scale(src, n));
  for (int i = 0; i < n; i += 16) vstore(dst + i, vmul(vload(src + i), scale));
}
#endif
#if PAGODA_AVX2
// n codes (a multiple of 16) -> their values as bf16 (exact: every e5m2 and e4m3 value is one), what
// the decode kernel reads: the prefill kernel's rows of a one-byte cache.
template <typename CT>
inline void f8_values_row(const CT* src, bf16_t* dst, int n) {
  for (int i = 0; i < n; i += 16) {
    const V16 f = vload(src + i);
    const __m256i w = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(f.lo), 16),
                                          _mm256_srli_epi32(_mm256_castps_si256(f.hi), 16));
    // packus interleaves the halves' 128-bit lanes: lo 0-3, hi 0-3, lo 4-7, hi 4-7
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm256_permute4x64_epi64(w, 0xD8));
  }
}
// An int8 cache's row of n codes and its scale -> bf16(code x scale), rounded to nearest even as the
// AVX512-BF16 staging rounds it.
inline void f8_values_row(const i8s_t* src, bf16_t* dst, int n) {
  const V16 scale = vset1(pagoda::row_scale(src, n));
  alignas(32) float f[16];
  for (int i = 0; i < n; i += 16) {
    vstore(f, vmul(vload(src + i), scale));
    for (int j = 0; j < 16; ++j) dst[i + j] = pagoda::float_to_bf16(f[j]);
  }
}
#endif

// 16 cache elements as the float32 decode path reads them: their values, but e4m3 codes at 2^-8 of
// theirs (one multiply fewer a chunk), which the path takes back in the scores' scale and in P
// (kSpanScale): exact powers of two, so the same bits.
template <typename C>
PAGODA_INLINE V16 vload_span(const C* p) {
#if PAGODA_AVX512 || PAGODA_AVX2
  if constexpr (std::is_same_v<C, f8e4m3_t>) return vload_e4m3_scaled(p);
#endif
  return vload(p);
}
template <typename C>
constexpr float kSpanScale = std::is_same_v<C, f8e4m3_t> ? 256.f : 1.f;

#if PAGODA_DPBF16
// e5m2 codes as bf16 words of their values times 2^-112, in three integer ops on the codes' float16
// bits (code << 8): an arithmetic shift right by 3 moves the sign, 5 exponent bits and 2 mantissa
// bits to bf16's places, and clearing bits 12-14 (copies of the sign) leaves the exponent field at
// the code's own, without bf16's larger bias. e4m3 codes the same way, shifted by 4 and bits 11-14
// cleared: their values times 2^-120. Subnormal codes land in bf16's subnormal range and read as
// zero (vdpbf16ps treats subnormal inputs as zero), e5m2's infinities and NaNs and e4m3's NaN as
// finite values: the decode kernel on a one-byte cache gives bitwise what it gives on a bf16 cache
// holding the codes' values with subnormals flushed (tests/test_cpu_attention.py), for queries
// below 2^16 in magnitude. To make up for it the queries are scaled by 2^112 (f8_scale_query; an
// e4m3 cache's scores are then 2^-8 of theirs, which the softmax's scale takes back, run_item) and
// the probabilities P by 2^112 or 2^120 (f8_scale_p): exponent adds, exact, and a product of a
// scaled pair is the product of the unscaled ones times a power of two, so the scores and P @ V are
// the same bits.
template <int F8>
constexpr int kF8ExpShift = F8 == kE4M3 ? 120 : 112;  // 127 - 7 or 127 - 15: bf16's bias less the code's
constexpr int kF8QueryShift = 112;
template <int F8>
PAGODA_INLINE __m512i f8_words(__m512i code_hi) {
  static_assert(F8 == kE5M2 || F8 == kE4M3);
  if constexpr (F8 == kE5M2)
    return _mm512_and_si512(_mm512_srai_epi16(code_hi, 3), _mm512_set1_epi16(static_cast<short>(0x8FFF)));
  else
    return _mm512_and_si512(_mm512_srai_epi16(code_hi, 4), _mm512_set1_epi16(static_cast<short>(0x87FF)));
}
template <int F8>
PAGODA_INLINE __m256i f8_words(__m256i code_hi) {
  static_assert(F8 == kE5M2 || F8 == kE4M3);
  if constexpr (F8 == kE5M2)
    return _mm256_and_si256(_mm256_srai_epi16(code_hi, 3), _mm256_set1_epi16(static_cast<short>(0x8FFF)));
  else
    return _mm256_and_si256(_mm256_srai_epi16(code_hi, 4), _mm256_set1_epi16(static_cast<short>(0x87FF)));
}
// With AVX512-VBMI a byte permute (vpermb, one uop; the other bytes zeroed) puts each code in its
// word's high byte: the code << 8 that the widening and the shift give without it.
#if defined(__AVX512VBMI__)
#define PAGODA_F8_VBMI 1
constexpr __mmask64 kHighBytes = 0xAAAAAAAAAAAAAAAAull;
// vpermb indices: byte 2w + 1 of the result from byte src(w) of the source (kind 0: w; 1 and 2:
// f8_load32_interleaved's lo and hi, token a in bytes 0-31 and b in 32-63).
struct F8Index {
  alignas(64) uint8_t b[64] = {};
  constexpr explicit F8Index(int kind) {
    for (int w = 0; w < 32; ++w)
      b[2 * w + 1] = static_cast<uint8_t>(kind == 0 ? w : (w & 1) * 32 + (w & ~7) + (kind == 2 ? 4 : 0) + (w & 7) / 2);
  }
};
constexpr F8Index kF8Plain{0}, kF8Lo{1}, kF8Hi{2};
template <int F8>
PAGODA_INLINE __m512i f8_permute(const F8Index& idx, __m512i codes) {
  return f8_words<F8>(_mm512_maskz_permutexvar_epi8(kHighBytes, _mm512_load_si512(idx.b), codes));
}
#else
#define PAGODA_F8_VBMI 0
#endif
// 16 int8 codes (kI8) as floats, exactly: the prefill kernel's rows of an int8 cache (decode
// multiplies the codes as integers: span_scores, attend_span_bf16).
PAGODA_INLINE __m512 i8_values16(const uint8_t* p) { return vload(reinterpret_cast<const i8s_t*>(p)).v; }
// The one-byte codes' loads below are float8 codes' (pagoda::f8_codes).
// 32 codes in a 256-bit register -> 32 words, in order.
template <int F8>
PAGODA_INLINE __m512i f8_words32(__m256i codes) {
  static_assert(pagoda::f8_codes(F8), "an int8 cache's codes are multiplied as integers");
#if PAGODA_F8_VBMI
  return f8_permute<F8>(kF8Plain, _mm512_castsi256_si512(codes));
#else
  return f8_words<F8>(_mm512_slli_epi16(_mm512_cvtepu8_epi16(codes), 8));
#endif
}
// 32 codes -> 32 words.
template <int F8>
PAGODA_INLINE __m512i f8_load32(const uint8_t* p) {
  return f8_words32<F8>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 codes at p0 and 16 at p1 -> 16 words each, in the low and the high half.
template <int F8>
PAGODA_INLINE __m512i f8_load16x2(const uint8_t* p0, const uint8_t* p1) {
  return f8_words32<F8>(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0))),
                                                _mm_loadu_si128(reinterpret_cast<const __m128i*>(p1)), 1));
}
// 32 codes of token a and 32 of token b (pb null: zeros) -> the words unpacklo_epi16 /
// unpackhi_epi16 of their f8_load32 words give, straight from the codes where vpermb is there.
template <int F8>
PAGODA_INLINE void f8_load32_interleaved(const uint8_t* pa, const uint8_t* pb, __m512i& lo, __m512i& hi) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pa));
  const __m256i b = pb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pb)) : _mm256_setzero_si256();
#if PAGODA_F8_VBMI
  static_assert(pagoda::f8_codes(F8), "an int8 cache's codes are multiplied as integers");
  const __m512i ab = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  lo = f8_permute<F8>(kF8Lo, ab);
  hi = f8_permute<F8>(kF8Hi, ab);
#else
  const __m512i wa = f8_words32<F8>(a), wb = f8_words32<F8>(b);
  lo = _mm512_unpacklo_epi16(wa, wb);
  hi = _mm512_unpackhi_epi16(wa, wb);
#endif
}
// 16 codes -> 16 words.
template <int F8>
PAGODA_INLINE __m256i f8_load16(const uint8_t* p) {
  static_assert(pagoda::f8_codes(F8), "an int8 cache's codes are multiplied as integers");
  return f8_words<F8>(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 8));
}
// n codes (a multiple of 16) -> the bf16 values they hold, subnormal codes as +0 (what the decode
// kernel reads; infinities and NaNs as finite values): the prefill kernel's rows of a one-byte cache.
template <typename CT>
inline void f8_values_row(const CT* src, bf16_t* dst, int n) {
  constexpr int F8 = f8_kind<CT>();
  const auto* codes = reinterpret_cast<const uint8_t*>(src);
  for (int i = 0; i < n; i += 16) {
    const __m256i w = f8_load16<F8>(codes + i);
    const __mmask16 normal = _mm256_test_epi16_mask(w, _mm256_set1_epi16(0x7F80));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm256_maskz_add_epi16(normal, w, _mm256_set1_epi16(kF8ExpShift<F8> << 7)));
  }
}
// An int8 cache's row of n codes (a multiple of 16) and its scale -> bf16(code x scale): the prefill
// kernel's rows (decode multiplies the scores and P by the scale in float32 instead, so the two
// kernels' values differ by that rounding).
inline void f8_values_row(const i8s_t* src, bf16_t* dst, int n) {
  const __m512 scale = _mm512_set1_ps(pagoda::row_scale(src, n));
  const auto* codes = reinterpret_cast<const uint8_t*>(src);
  for (int i = 0; i < n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(i8_values16(codes + i), scale)));
}
// bf16 words with a nonzero exponent field times 2^112 (e5m2) or 2^120 (e4m3); subnormal words
// (zero to vdpbf16ps) as they are. P lies in [0, 1], so its exponent field stays below 255.
template <int F8>
PAGODA_INLINE __m512i f8_scale_p(__m512i w) {
  const __mmask32 normal = _mm512_test_epi16_mask(w, _mm512_set1_epi16(0x7F80));
  return _mm512_mask_add_epi16(w, normal, w, _mm512_set1_epi16(kF8ExpShift<F8> << 7));
}
// A query element times 2^112, with vdpbf16ps's view of it kept: a subnormal one stays zero, and
// one at or above 2^16 in magnitude (never a real query) saturates at bf16's largest finite value.
inline bf16_t f8_scale_query(bf16_t q) {
  const uint16_t u = q.x, exp = (u >> 7) & 0xFF, sign = u & 0x8000;
  if (exp == 0) return bf16_t{sign};
  if (exp + kF8QueryShift >= 255) return bf16_t{static_cast<uint16_t>(sign | 0x7F7F)};
  return bf16_t{static_cast<uint16_t>(u + (kF8QueryShift << 7))};
}
#endif

// An int8 cache's Q K^T in integer dot products (AVX512-VNNI's vpdpbusd, 64 code products a uop,
// no widening of the codes), bf16 queries: each query head is held as two int8 digits a value,
// q ~ s (hi + lo / 256) with s its largest magnitude / 127, |hi| <= 127 and lo the remainder's
// 256ths (|q - s (hi + lo / 256)| <= s / 512 = 2^-16 of the largest: finer than q's own bf16
// rounding for all but its smallest values). vpdpbusd multiplies unsigned bytes by signed ones,
// so the K codes go in with their sign bit flipped (code + 128) and the 128 x the digits' sum each
// row picks up comes off the scores afterwards (I8Query::bias). The products and their sums are
// exact integers; only the final lo / 256 combination rounds.
template <int F8>
constexpr bool kI8Dot = PAGODA_DPBF16 && F8 == kI8;
// A query head's digits, in its float32 query slot (Scratch::qf, 4 x head_dim bytes): hi codes
// [0, D), lo codes [D, 2D), then this.
struct I8Query {
  float scale;  // s: a score is s x (its digits' products, in hi units, less bias) x the K row's scale
  float bias;   // 128 x (sum of hi + sum of lo / 256)
};
inline const I8Query& i8_query(const float* slot, int D) {
  return *reinterpret_cast<const I8Query*>(reinterpret_cast<const char*>(slot) + 2 * D);
}
#if PAGODA_DPBF16
// Head_dim (a multiple of 16) bf16 queries -> their digits and I8Query in slot. A query holding a
// NaN or an infinity gets a NaN scale, so its scores are NaN, as bf16 products make them.
inline void i8_query_digits(const bf16_t* q, int D, float* slot) {
  auto* hi = reinterpret_cast<int8_t*>(slot);
  int8_t* lo = hi + D;
  __m512 vmax = _mm512_setzero_ps();
  __mmask16 finite = 0xFFFF;  // lanes below infinity in magnitude (false for NaN)
  for (int i = 0; i < D; i += 16) {
    const __m512 a = _mm512_abs_ps(vload(q + i).v);
    finite &= _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_LT_OQ);
    vmax = _mm512_max_ps(vmax, a);
  }
  const float amax = finite == 0xFFFF ? _mm512_reduce_max_ps(vmax) : std::numeric_limits<float>::quiet_NaN();
  // Below 2^-120 (a query of bf16 subnormals and the like, zero to vdpbf16ps too), or NaN: digits 0.
  const bool tiny = !(amax >= 0x1p-120f);
  const __m512 inv = _mm512_set1_ps(tiny ? 0.f : 127.f / amax);
  const __m512 top = _mm512_set1_ps(127.f), bottom = _mm512_set1_ps(-127.f), k256 = _mm512_set1_ps(256.f);
  __m512i shi = _mm512_setzero_si512(), slo = _mm512_setzero_si512();
  for (int i = 0; i < D; i += 16) {
    const __m512 x = _mm512_mul_ps(vload(q + i).v, inv);
    const __m512 h = _mm512_min_ps(top, _mm512_max_ps(bottom, _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT)));
    const __m512 l = _mm512_min_ps(top, _mm512_max_ps(bottom, _mm512_roundscale_ps(
                                                                  _mm512_mul_ps(_mm512_sub_ps(x, h), k256),
                                                                  _MM_FROUND_TO_NEAREST_INT)));
    const __m512i hi32 = _mm512_cvtps_epi32(h), lo32 = _mm512_cvtps_epi32(l);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(hi + i), _mm512_cvtepi32_epi8(hi32));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + i), _mm512_cvtepi32_epi8(lo32));
    shi = _mm512_add_epi32(shi, hi32);
    slo = _mm512_add_epi32(slo, lo32);
  }
  I8Query& d = *reinterpret_cast<I8Query*>(reinterpret_cast<char*>(slot) + 2 * D);
  d.scale = tiny && !std::isnan(amax) ? 0.f : amax / 127.f;
  d.bias = 128.f * (static_cast<float>(_mm512_reduce_add_epi32(shi)) +
                    static_cast<float>(_mm512_reduce_add_epi32(slo)) / 256.f);
}
#endif

// Software prefetch of one row into L2, a line at a time. Measured on Zen 4 (one core, reading 6 KB
// blocks at random places, no arithmetic): L2 prefetches spread over the reads stream ~17 GB/s, L1
// prefetches ~12, none ~10 (the hardware prefetchers do not follow into a random next block).
PAGODA_INLINE void prefetch_row_l2(const void* row, int bytes) {
  const char* p = static_cast<const char*>(row);
  for (int o = 0; o < bytes; o += 64) prefetch_l2(p + o);
  if (bytes & 63) prefetch_l2(p + bytes - 1);
}

// Requests the lines of [p, p + bytes) into L2.
PAGODA_INLINE void prefetch_range_l2(const void* p, int bytes) {
  const char* end = static_cast<const char*>(p) + bytes;
  for (const char* a = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}); a < end; a += 64)
    prefetch_l2(a);
}

constexpr bool kPairChunks = PAGODA_AVX2;  // attend_span's P @ V: two 16-column chunks a walk
constexpr int kSpan = 32;            // tokens per decode span (two 16-lane score vectors per head)
constexpr int kMaxGroupHeads = 9;    // q heads per span call (kv heads x their q heads, see run_item)
constexpr int kMaxGroupRows = 16;    // rows of one sequence attended by one item (run_item, group_rows)
// 32-token spans halve the softmax work per token (8% faster from L2), but a span's parked scores and
// K/V rows must fit L1 beside the rest: above kMaxSpanBytes the spans are 16 tokens (Llama-8B shapes:
// 2 kv heads x 4 q heads a pass, 48 KB: 16-token spans 12-17% faster, DRAM-bound).
constexpr int kMaxSpanBytes = 44 << 10;

// One call covers a span for the item's nkv kv heads and, of each kv head's g q heads, the NH heads
// j0 .. j0 + NH - 1. Head h = kh * g + j0 + j of the item: queries at q + h * D, accumulators at
// acc + h * D, running max m[h], sums lsum[h].
struct SpanArgs {
  const void* const* krow;  // [n]: token t's K row of the item's first kv head
  const void* const* vrow;
  int64_t ks2, vs2;         // element stride between kv heads in a row
  // [n] or null (no prefetching in this call): the K / V row (first kv head) of the token `ahead`
  // places after each of the span's, null past the item's end. Each kv head's pass requests its own
  // pf_bytes of them into L2 (K in the scores loop, V in the P @ V loop).
  const void* const* kpf;
  const void* const* vpf;
  int pf_bytes;
  int n, D, nkv, g;
  float qscale;
};

// An int8 cache's per-token scales for kv head kh of a span's n tokens (rows at A.krow / A.vrow),
// zero past n: each token's K scale multiplies its scores, its V scale its probability (the
// softmax's sums take the probabilities unscaled).
PAGODA_INLINE void span_row_scales(const SpanArgs& A, int kh, int D, float* kscale, float* vscale) {
  const auto* const* krow = reinterpret_cast<const int8_t* const*>(A.krow);
  const auto* const* vrow = reinterpret_cast<const int8_t* const*>(A.vrow);
  for (int t = 0; t < A.n; ++t) {
    kscale[t] = pagoda::row_scale(krow[t] + kh * A.ks2, D);
    vscale[t] = pagoda::row_scale(vrow[t] + kh * A.vs2, D);
  }
  for (int t = A.n; t < kSpan; ++t) kscale[t] = vscale[t] = 0.f;
}

// Online-softmax update of one head over the span's scores s[0..1] (lanes >= n of the span masked):
// returns the rescale factor of the accumulators and leaves the probabilities in e[0..1].
PAGODA_INLINE float softmax_span(V16* s, int n, float qscale, float& m, V16& lsum, V16* e);
// softmax_span, with an int8 cache's scales (span_row_scales) around it for kI8: the K scales on the
// scores, the V scales on the probabilities after the sums took them.
template <int F8>
PAGODA_INLINE float softmax_span_scaled(V16* s, int n, float qscale, float& m, V16& lsum, V16* e,
                                        const float* kscale, const float* vscale) {
  if constexpr (F8 == kI8) {
    s[0] = vmul(s[0], vload(kscale));
    s[1] = vmul(s[1], vload(kscale + kTile));
  }
  const float alpha = softmax_span(s, n, qscale, m, lsum, e);
  if constexpr (F8 == kI8) {
    e[0] = vmul(e[0], vload(vscale));
    e[1] = vmul(e[1], vload(vscale + kTile));
  }
  return alpha;
}
PAGODA_INLINE float softmax_span(V16* s, int n, float qscale, float& m, V16& lsum, V16* e) {
  const V16 vscale = vset1(qscale);
  s[0] = vmask_ninf(vmul(s[0], vscale), std::min(n, kTile));
  s[1] = vmask_ninf(vmul(s[1], vscale), std::max(0, n - kTile));
  float alpha = 1.f;
#if PAGODA_AVX512
  // Past the first spans the running max rarely moves: two lane-wise compares (true for a lane
  // above m or a NaN) skip the horizontal reduction, whose only use is that test.
  const __m512 vm = _mm512_set1_ps(m);
  if (_mm512_cmp_ps_mask(s[0].v, vm, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(s[1].v, vm, _CMP_NLE_UQ)) {
    const float tmax = _mm512_reduce_max_ps(_mm512_max_ps(s[0].v, s[1].v));
#else
  {
    const float tmax = std::max(vreduce_max(s[0]), vreduce_max(s[1]));
#endif
    if (tmax > m) {
      alpha = std::exp2(m - tmax);  // 0 on the first span (m = -inf)
      m = tmax;
      lsum = vmul(lsum, vset1(alpha));
    }
  }
  const V16 negm = vset1(-m);
  e[0] = vexp2_masked(vadd(s[0], negm), std::min(n, kTile));
  e[1] = vexp2_masked(vadd(s[1], negm), std::max(0, n - kTile));
  lsum = vadd(lsum, vadd(e[0], e[1]));
  return alpha;
}

#if PAGODA_DPBF16
// span_scores for an int8 cache in integer dot products (i8_query_digits), one token a vector: a
// kv head's row in 64-code chunks (a last partial one masked), tmp[(kh * NH + j) * kSpan + t] gets
// the 16-lane partial sums in hi units (the bias still on). The full chunks' loads are plain, so
// the digits' ones fold into vpdpbusd: with masked loads throughout, Llama-8B shapes ran 2-6% slower
// (Zen 4, hot and from DRAM).
template <int NH>
PAGODA_INLINE void span_scores_i8dot(const SpanArgs& A, const float* qf, V16* tmp) {
  const int D = A.D, n = A.n, nkv = A.nkv, g = A.g;
  const auto* const* krc = reinterpret_cast<const uint8_t* const*>(A.krow);
  const auto* const* kpc = reinterpret_cast<const uint8_t* const*>(A.kpf);
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512 lo_unit = _mm512_set1_ps(1.f / 256.f);
  const int nfull = D / 64;
  const __mmask64 last = (__mmask64{1} << (D % 64)) - 1;  // a partial chunk's codes (the digits past D: zero)
  for (int t = 0; t < n; ++t) {
    for (int kh = 0; kh < nkv; ++kh) {
      if (kpc && kpc[t]) prefetch_range_l2(kpc[t] + kh * A.ks2, A.pf_bytes);
      const uint8_t* kp = krc[t] + kh * A.ks2;
      __m512i ph[NH], pl[NH];
      for (int j = 0; j < NH; ++j) ph[j] = pl[j] = _mm512_setzero_si512();
      const auto chunk = [&](int c, auto load) __attribute__((always_inline)) {
        const __m512i kv = _mm512_xor_si512(load(kp + c * 64), flip);
        for (int j = 0; j < NH; ++j) {
          const auto* digits = reinterpret_cast<const uint8_t*>(qf + (static_cast<size_t>(kh) * g + j) * D);
          ph[j] = _mm512_dpbusd_epi32(ph[j], kv, load(digits + c * 64));
          pl[j] = _mm512_dpbusd_epi32(pl[j], kv, load(digits + D + c * 64));
        }
      };
      for (int c = 0; c < nfull; ++c)
        chunk(c, [](const uint8_t* p) __attribute__((always_inline)) { return _mm512_loadu_si512(p); });
      if (D % 64)
        chunk(nfull, [last](const uint8_t* p) __attribute__((always_inline)) { return _mm512_maskz_loadu_epi8(last, p); });
      for (int j = 0; j < NH; ++j)
        tmp[(kh * NH + j) * kSpan + t].v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pl[j]), lo_unit, _mm512_cvtepi32_ps(ph[j]));
    }
  }
  const int nfill = n <= kTile ? kTile : kSpan;
  for (int r = 0; r < nkv * NH; ++r)
    for (int t = n; t < nfill; ++t) tmp[r * kSpan + t] = vzero();
}
#endif

#if PAGODA_DPBF16
// span_scores' walk over a span's n tokens two at a time: for pair p (tokens 2p and 2p + 1; an odd
// span's last pair repeats token 2p, whose lanes the softmax masks) and each of NKV kv heads,
// body(p, kh, the two K rows of kv head kh), after requesting kv head kh's part of the rows
// `ahead` (A.kpf) into L2. Returns the number of pairs.
template <int NKV, typename CE, typename F>
PAGODA_INLINE int for_token_pairs(const SpanArgs& A, const CE* const* krc, const CE* const* kpc, F&& body) {
  const int n = A.n, npairs = (n + 1) / 2;
  for (int p = 0; p < npairs; ++p) {
    const int t = 2 * p;
    const bool two = t + 1 < n;
    const CE* kr0 = krc[t];
    const CE* kr1 = two ? krc[t + 1] : kr0;
    const CE* pf0 = kpc ? kpc[t] : nullptr;
    const CE* pf1 = kpc && two ? kpc[t + 1] : nullptr;
#pragma GCC unroll 16
    for (int kh = 0; kh < NKV; ++kh) {
      if (pf0) prefetch_range_l2(pf0 + kh * A.ks2, A.pf_bytes);
      if (pf1) prefetch_range_l2(pf1 + kh * A.ks2, A.pf_bytes);
      body(p, kh, kr0 + kh * A.ks2, kr1 + kh * A.ks2);
    }
  }
  return npairs;
}
#endif

// Scores of a span: token by token, and within a token kv head by kv head, so the K rows are read in
// address order (one contiguous run per token in the usual layout; SmolLM2 shapes, one core,
// DRAM-bound: ~15% faster than one kv head's rows at a time). tmp[(kh * NH + j) * kSpan + t] gets
// the 16-lane partial dot products.
//
// NKV > 0 (bf16 with vdpbf16ps, DT > 0): the call covers exactly NKV kv heads, whose NKV x NH
// queries are held in registers for the whole span (with a runtime kv-head count they were reloaded
// for every token: a store to tmp may alias them). SmolLM2 shapes, one core, from L2: 1.07x.
//
// F8: the K rows are one-byte codes (kE5M2: f8e5m2_t, kE4M3: f8e4m3_t). vdpbf16ps builds with bf16
// queries: qraw scaled by 2^112, f8_words; float32 queries, and bf16 ones on AVX2 builds: the codes
// widened to floats (vload_span), against qf.
template <typename T, int NH, int DT, int NKV, int F8 = kNoF8>
PAGODA_INLINE void span_scores(const SpanArgs& A, const float* qf, const T* qraw, V16* tmp) {
  const int D = DT ? DT : A.D;
  const int n = A.n, nkv = A.nkv, g = A.g;
#if PAGODA_DPBF16
  using CE = std::conditional_t<F8 != kNoF8, uint8_t, bf16_t>;  // a cache element as the bf16 paths read it
  [[maybe_unused]] const CE* const* krc = reinterpret_cast<const CE* const*>(A.krow);
  [[maybe_unused]] const CE* const* kpc = reinterpret_cast<const CE* const*>(A.kpf);
  if constexpr (kI8Dot<F8> && std::is_same_v<T, bf16_t> && NKV > 0) {
    // An int8 cache in integer dot products (i8_query_digits), two tokens a vector as below: 32
    // codes of token t in the low half and of token t + 1 in the high, against a 32-code chunk of
    // each digit of the query in both halves.
    static_assert(DT > 0 && DT % 32 == 0, "paired int8 tokens need a compile-time head_dim, a multiple of 32");
    constexpr int NQ = DT / 32;
    (void)qraw;
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i qh[NKV][NH][NQ], ql[NKV][NH][NQ];
    for (int kh = 0; kh < NKV; ++kh)
      for (int j = 0; j < NH; ++j) {
        const auto* digits = reinterpret_cast<const uint8_t*>(qf + (static_cast<size_t>(kh) * g + j) * DT);
        for (int c = 0; c < NQ; ++c) {
          qh[kh][j][c] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(digits + c * 32)));
          ql[kh][j][c] =
              _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(digits + DT + c * 32)));
        }
      }
    const __m512 lo_unit = _mm512_set1_ps(1.f / 256.f);
    const int npairs = for_token_pairs<NKV>(A, krc, kpc, [&](int p, int kh, const CE* kp0, const CE* kp1)
                                                              __attribute__((always_inline)) {
      __m512i ph[NH], pl[NH];
      for (int j = 0; j < NH; ++j) ph[j] = pl[j] = _mm512_setzero_si512();
      for (int c = 0; c < NQ; ++c) {
        const __m512i kv = _mm512_xor_si512(
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp0 + c * 32))),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp1 + c * 32)), 1),
            flip);
        for (int j = 0; j < NH; ++j) {
          ph[j] = _mm512_dpbusd_epi32(ph[j], kv, qh[kh][j][c]);
          pl[j] = _mm512_dpbusd_epi32(pl[j], kv, ql[kh][j][c]);
        }
      }
      for (int j = 0; j < NH; ++j)
        tmp[(kh * NH + j) * kSpan + p].v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(pl[j]), lo_unit, _mm512_cvtepi32_ps(ph[j]));
    });
    const int nfill = (n <= kTile ? kTile : kSpan) / 2;
    for (int r = 0; r < NKV * NH; ++r)
      for (int p = npairs; p < nfill; ++p) tmp[r * kSpan + p] = vzero();
    return;
  } else if constexpr (std::is_same_v<T, bf16_t> && NKV > 0) {
    // Two tokens a vector: the low 256 bits hold token t's part of a chunk, the high token t + 1's,
    // against the queries' chunk in both halves, so a token's products land in 8 lanes, not 16, and
    // hsum_pairs has half the reduction tree to run. tmp[(kh * NH + j) * kSpan + t / 2] gets the
    // pair's partial sums.
    static_assert(DT > 0 && DT % 16 == 0, "paired tokens need a compile-time head_dim, a multiple of 16");
    constexpr int NQ = DT / 16;
    (void)qf;
    __m512bh qd[NKV][NH][NQ];
    for (int kh = 0; kh < NKV; ++kh)
      for (int j = 0; j < NH; ++j)
        for (int c = 0; c < NQ; ++c)
          qd[kh][j][c] = (__m512bh)_mm512_broadcast_i64x4(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qraw + (static_cast<size_t>(kh) * g + j) * DT + c * 16)));
    const int npairs = for_token_pairs<NKV>(A, krc, kpc, [&](int p, int kh, const CE* kp0, const CE* kp1)
                                                              __attribute__((always_inline)) {
      __m512 part[NH];
      for (int j = 0; j < NH; ++j) part[j] = _mm512_setzero_ps();
      for (int c = 0; c < NQ; ++c) {
        __m512bh kv;
        if constexpr (F8 != kNoF8)
          kv = (__m512bh)f8_load16x2<F8>(kp0 + c * 16, kp1 + c * 16);
        else
          kv = (__m512bh)_mm512_inserti64x4(
              _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp0 + c * 16))),
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kp1 + c * 16)), 1);
        for (int j = 0; j < NH; ++j) part[j] = _mm512_dpbf16_ps(part[j], qd[kh][j][c], kv);
      }
      for (int j = 0; j < NH; ++j) tmp[(kh * NH + j) * kSpan + p].v = part[j];
    });
    const int nfill = (n <= kTile ? kTile : kSpan) / 2;
    for (int r = 0; r < NKV * NH; ++r)
      for (int p = npairs; p < nfill; ++p) tmp[r * kSpan + p] = vzero();
    return;
  }
  if constexpr (kI8Dot<F8> && std::is_same_v<T, bf16_t>) {  // int8 dot products, one token a vector
    span_scores_i8dot<NH>(A, qf, tmp);
    return;
  } else if constexpr (std::is_same_v<T, bf16_t>) {  // one token a vector
    (void)qf;
    const int nc = D / 32;
    for (int t = 0; t < n; ++t) {
      for (int kh = 0; kh < nkv; ++kh) {
        if (kpc && kpc[t]) prefetch_range_l2(kpc[t] + kh * A.ks2, A.pf_bytes);
        const CE* kp = krc[t] + kh * A.ks2;
        const bf16_t* qh = qraw + static_cast<size_t>(kh) * g * D;
        __m512 part[NH];
        for (int j = 0; j < NH; ++j) part[j] = _mm512_setzero_ps();
        for (int c = 0; c < nc; ++c) {
          __m512bh kv;
          if constexpr (F8 != kNoF8)
            kv = (__m512bh)f8_load32<F8>(kp + c * 32);
          else
            kv = (__m512bh)_mm512_loadu_si512(kp + c * 32);
          for (int j = 0; j < NH; ++j)
            part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)_mm512_loadu_si512(qh + j * D + c * 32), kv);
        }
        if (D % 32) {  // D % 32 == 16: one half-width chunk
          __m512bh kv;
          if constexpr (F8 != kNoF8)
            kv = (__m512bh)_mm512_zextsi256_si512(f8_load16<F8>(kp + nc * 32));
          else
            kv = (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, kp + nc * 32);
          for (int j = 0; j < NH; ++j)
            part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, qh + j * D + nc * 32), kv);
        }
        for (int j = 0; j < NH; ++j) tmp[(kh * NH + j) * kSpan + t].v = part[j];
      }
    }
    const int nfill = n <= kTile ? kTile : kSpan;
    for (int r = 0; r < nkv * NH; ++r)
      for (int t = n; t < nfill; ++t) tmp[r * kSpan + t] = vzero();
    return;
  } else  // (the float path below: float32 queries here, on a cache of float32 or of codes)
#endif
  {
    // The cache element: T's, or a one-byte code (vload_span widens it).
    using KC = CacheElem<T, F8>;
    const KC* const* krow = reinterpret_cast<const KC* const*>(A.krow);
    const KC* const* kpf = reinterpret_cast<const KC* const*>(A.kpf);
    for (int t = 0; t < n; ++t) {
      for (int kh = 0; kh < nkv; ++kh) {
        if (kpf && kpf[t]) prefetch_range_l2(kpf[t] + kh * A.ks2, A.pf_bytes);
        const KC* kp = krow[t] + kh * A.ks2;
        (void)qraw;
        const float* qh = qf + static_cast<size_t>(kh) * g * D;
        V16 part[NH];
        for (int j = 0; j < NH; ++j) part[j] = vzero();
        for (int c = 0; c < D / kTile; ++c) {
          V16 kv = vload_span(kp + c * kTile);
          for (int j = 0; j < NH; ++j) part[j] = vfma(vload(qh + j * D + c * kTile), kv, part[j]);
        }
        for (int j = 0; j < NH; ++j) tmp[(kh * NH + j) * kSpan + t] = part[j];
      }
    }
    const int nfill = n <= kTile ? kTile : kSpan;
    for (int r = 0; r < nkv * NH; ++r)
      for (int t = n; t < nfill; ++t) tmp[r * kSpan + t] = vzero();
  }
}

// ------------------------------------------------------------------------------------------
// Decode: one span of up to kSpan tokens for the item (see SpanArgs). Scores kept in the log2
// domain (qscale = scale * log2(e)); acc: unnormalized output accumulators, m: running max, lsum:
// 16-lane partial running sums. DT: head_dim known at compile time (0: use A.D). F8: the caches hold
// one-byte codes, read through vload_span (AVX2 builds, and float32 queries on AVX-512; bf16 queries
// on vdpbf16ps builds use attend_span_bf16).
// ------------------------------------------------------------------------------------------
template <typename T, int NH, int DT, int F8 = kNoF8>
void attend_span(const SpanArgs& A, const float* qf, const T* qraw, float* acc, float* m, V16* lsum, V16* tmp) {
  using VC = CacheElem<T, F8>;
  const int D = DT ? DT : A.D;
  const int nc = D / kTile;
  const int n = A.n, g = A.g;
  const VC* const* vrow = reinterpret_cast<const VC* const*>(A.vrow);
  const VC* const* vpf = reinterpret_cast<const VC* const*>(A.vpf);
  span_scores<T, NH, DT, 0, F8>(A, qf, qraw, tmp);
  for (int kh = 0; kh < A.nkv; ++kh) {
    float p[NH][2 * kTile];
    float alpha[NH];
    alignas(64) float kscale[kSpan], vscale[kSpan];  // int8 codes: each token's scales
    if constexpr (F8 == kI8) span_row_scales(A, kh, D, kscale, vscale);
    for (int j = 0; j < NH; ++j) {
      const V16* tj = tmp + (kh * NH + j) * kSpan;
      V16 s[2] = {hsum16(tj), n > kTile ? hsum16(tj + kTile) : vzero()};
      V16 e[2];
      alpha[j] = softmax_span_scaled<F8>(s, n, A.qscale, m[kh * g + j], lsum[kh * g + j], e, kscale, vscale);
      if constexpr (kSpanScale<VC> != 1.f) {  // V read at 2^-8 of its values (vload_span)
        e[0] = vmul(e[0], vset1(kSpanScale<VC>));
        e[1] = vmul(e[1], vset1(kSpanScale<VC>));
      }
      vstore(p[j], e[0]);
      vstore(p[j] + kTile, e[1]);
    }
    // acc = acc * alpha + P @ V, one 16-wide column chunk at a time (NH accumulators in registers).
    float* acch = acc + static_cast<size_t>(kh) * g * D;
    int c = 0;
    // AVX2: two chunks a walk over the span's V rows (half the walks; each accumulator still sums
    // the tokens in order, so the same bits). Zen 3, fp32, every decode call of a W run
    // (bench/decode_kernel_ab.py --first-only): 1.06x.
    for (; kPairChunks && c + 1 < nc; c += 2) {
      V16 a[NH], b[NH];
      for (int j = 0; j < NH; ++j) {
        a[j] = vmul(vload(acch + j * D + c * kTile), vset1(alpha[j]));
        b[j] = vmul(vload(acch + j * D + (c + 1) * kTile), vset1(alpha[j]));
      }
      for (int t = 0; t < n; ++t) {
        if (c == 0 && vpf && vpf[t]) prefetch_range_l2(vpf[t] + kh * A.vs2, A.pf_bytes);
        const VC* vr = vrow[t] + kh * A.vs2 + c * kTile;
        for (int j = 0; j < NH; ++j) {
          const V16 pj = vset1(p[j][t]);
          a[j] = vfma(pj, vload_span(vr), a[j]);
          b[j] = vfma(pj, vload_span(vr + kTile), b[j]);
        }
      }
      for (int j = 0; j < NH; ++j) {
        vstore(acch + j * D + c * kTile, a[j]);
        vstore(acch + j * D + (c + 1) * kTile, b[j]);
      }
    }
    for (; c < nc; ++c) {
      V16 a[NH];
      for (int j = 0; j < NH; ++j) a[j] = vmul(vload(acch + j * D + c * kTile), vset1(alpha[j]));
      for (int t = 0; t < n; ++t) {
        if (c == 0 && vpf && vpf[t]) prefetch_range_l2(vpf[t] + kh * A.vs2, A.pf_bytes);
        V16 vv = vload_span(vrow[t] + kh * A.vs2 + c * kTile);
        for (int j = 0; j < NH; ++j) a[j] = vfma(vset1(p[j][t]), vv, a[j]);
      }
      for (int j = 0; j < NH; ++j) vstore(acch + j * D + c * kTile, a[j]);
    }
  }
}

#if PAGODA_DPBF16
// P @ V's accumulators over a span, 16 lanes of an accumulator row: float32 ones that start at the
// row times alpha and take vdpbf16ps of bf16 P and V words; for an int8 cache (kI8Dot) int32 ones
// that start at zero and take vpdpwssd of P as int16 multiples of its unit (its largest / 32767
// a head and span, attend_span_bf16) and V's codes as int16 words, exact, added to the row times
// alpha at the span's end. (P to 15 bits of its largest, where bf16 gives each value 8 of its own.)
template <int F8>
using PvAcc = std::conditional_t<kI8Dot<F8>, __m512i, __m512>;
template <int F8>
PAGODA_INLINE PvAcc<F8> pv_start(const float* row, float alpha) {
  if constexpr (kI8Dot<F8>) return _mm512_setzero_si512();
  else return _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_set1_ps(alpha));
}
template <int F8>
PAGODA_INLINE PvAcc<F8> pv_dot(PvAcc<F8> acc, __m512i v, __m512i p) {
  if constexpr (kI8Dot<F8>) return _mm512_dpwssd_epi32(acc, v, p);
  else return _mm512_dpbf16_ps(acc, (__m512bh)v, (__m512bh)p);
}
template <int F8>
PAGODA_INLINE void pv_finish(float* row, PvAcc<F8> acc, float alpha, float punit) {
  if constexpr (kI8Dot<F8>)
    _mm512_storeu_ps(row, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(punit),
                                          _mm512_mul_ps(_mm512_loadu_ps(row), _mm512_set1_ps(alpha))));
  else
    _mm512_storeu_ps(row, acc);
}

// bf16 decode span. Scores: vdpbf16ps, 32 bf16 products per instruction straight from the cache
// rows (bf16 x bf16 products are exact in fp32). P @ V: P rounded to bf16 (as FlashAttention does),
// two tokens' V rows interleaved with unpacklo/hi_epi16 so one vdpbf16ps adds both tokens' terms for
// 16 dims. The interleave permutes head_dim within each 32-wide chunk: accumulator lane i of the low
// half holds d = 8 (i / 4) + i % 4, of the high half d = 8 (i / 4) + 4 + i % 4 (acc_perm_index); a
// trailing 16-wide chunk (D % 32 == 16) stays in natural order.
//
// F8: the cache holds one-byte codes, read as bf16 words of their values times 2^-112 or 2^-120
// (f8_words), with qraw scaled by 2^112 (run_item) and P scaled here: the same bits as a bf16 cache
// of their values. kI8 (an int8 cache): the codes multiplied as integers, the scores in span_scores
// (i8_query_digits), P V with V's codes as int16 words against P in int16 (PvAcc); each token's
// scales applied to its scores and to its probability here.
template <int NH, int DT, int NKV, int F8 = kNoF8>
void attend_span_bf16(const SpanArgs& A, const float* qf, const bf16_t* qraw, float* acc, float* m, V16* lsum,
                      V16* tmp) {
  using CE = std::conditional_t<F8 != kNoF8, uint8_t, bf16_t>;
  const int D = DT ? DT : A.D;
  const int nc = D / 32;
  const bool tail = (D % 32) != 0;
  const int n = A.n, g = A.g;
  const CE* const* vrow = reinterpret_cast<const CE* const*>(A.vrow);
  const CE* const* vpf = reinterpret_cast<const CE* const*>(A.vpf);
  span_scores<bf16_t, NH, DT, NKV, F8>(A, qf, qraw, tmp);
  const int npairs = (n + 1) / 2;
  const bool odd = n & 1;
  for (int kh = 0; kh < (NKV ? NKV : A.nkv); ++kh) {
    alignas(64) uint16_t p16[NH][2 * kTile];
    float alpha[NH];
    float punit[NH] = {};  // kI8Dot: P's unit (p16 holds int16 multiples of it)
    alignas(64) float kscale[kSpan], vscale[kSpan];  // int8 codes: each token's scales (applied before
                                                     // P is rounded)
    if constexpr (F8 == kI8) span_row_scales(A, kh, D, kscale, vscale);
    for (int j = 0; j < NH; ++j) {
      const V16* tj = tmp + (kh * NH + j) * kSpan;
      V16 s[2];
      if constexpr (NKV > 0) {  // paired tokens (span_scores)
        s[0] = hsum_pairs(tj);
        s[1] = n > kTile ? hsum_pairs(tj + kTile / 2) : vzero();
      } else {
        s[0] = hsum16(tj);
        s[1] = n > kTile ? hsum16(tj + kTile) : vzero();
      }
      float qscale = A.qscale;
      if constexpr (kI8Dot<F8>) {  // the scores in hi units, the bias still on (span_scores)
        const I8Query& iq = i8_query(qf + (static_cast<size_t>(kh) * g + j) * D, D);
        s[0] = vadd(s[0], vset1(-iq.bias));
        s[1] = vadd(s[1], vset1(-iq.bias));
        qscale *= iq.scale;
      }
      V16 e[2];
      alpha[j] = softmax_span_scaled<F8>(s, n, qscale, m[kh * g + j], lsum[kh * g + j], e, kscale, vscale);
      if constexpr (kI8Dot<F8>) {  // P as int16 words in units of its largest / 32767 (PvAcc)
        const float pmax = _mm512_reduce_max_ps(_mm512_max_ps(e[0].v, e[1].v));
        const __m512 inv = _mm512_set1_ps(pmax > 0.f ? 32767.f / pmax : 0.f);
        punit[j] = pmax / 32767.f;
        _mm512_store_si512(p16[j], _mm512_inserti64x4(
                                       _mm512_castsi256_si512(_mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(e[0].v, inv)))),
                                       _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(e[1].v, inv))), 1));
        continue;
      }
      const __m512i pw = (__m512i)_mm512_cvtne2ps_pbh(e[1].v, e[0].v);
      if constexpr (pagoda::f8_codes(F8))
        _mm512_store_si512(p16[j], f8_scale_p<F8>(pw));
      else
        _mm512_store_si512(p16[j], pw);
    }
    float* acch = acc + static_cast<size_t>(kh) * g * D;
    const int64_t vo = kh * A.vs2;
    // CW 32-wide chunks a walk over the span's V rows: all of them where the 4 * CW * NH / 2
    // accumulators fit the registers beside the rows (head_dim 64, up to 3 heads), so the walk's
    // bookkeeping and P's broadcasts serve the whole row; else one. Each accumulator still adds the
    // tokens in order: the same bits either way.
    constexpr int CW = (DT > 0 && DT % 32 == 0 && 2 * (DT / 32) * NH <= 12) ? DT / 32 : 1;
    for (int c0 = 0; c0 < nc; c0 += CW) {
      PvAcc<F8> lo[CW][NH], hi[CW][NH];
      for (int w = 0; w < CW; ++w)
        for (int j = 0; j < NH; ++j) {
          lo[w][j] = pv_start<F8>(acch + j * D + (c0 + w) * 32, alpha[j]);
          hi[w][j] = pv_start<F8>(acch + j * D + (c0 + w) * 32 + 16, alpha[j]);
        }
      // Tokens 2 tp and 2 tp + 1 (LAST: an odd span's last token alone, its partner's terms zero).
      const auto pair = [&](int tp, auto last) __attribute__((always_inline)) {
        constexpr bool LAST = decltype(last)::value;
        if (c0 == 0 && vpf) {
          if (vpf[2 * tp]) prefetch_range_l2(vpf[2 * tp] + vo, A.pf_bytes);
          if (!LAST && vpf[2 * tp + 1]) prefetch_range_l2(vpf[2 * tp + 1] + vo, A.pf_bytes);
        }
        __m512i pw[NH];
        for (int j = 0; j < NH; ++j) pw[j] = _mm512_set1_epi32(reinterpret_cast<const int32_t*>(p16[j])[tp]);
        for (int w = 0; w < CW; ++w) {
          __m512i vlo, vhi;
          if constexpr (pagoda::f8_codes(F8)) {
            f8_load32_interleaved<F8>(vrow[2 * tp] + vo + (c0 + w) * 32,
                                      LAST ? nullptr : vrow[2 * tp + 1] + vo + (c0 + w) * 32, vlo, vhi);
          } else {  // 32 words a row: bf16 values, or an int8 cache's codes as int16
            const auto words = [](const CE* p) __attribute__((always_inline)) {
              if constexpr (kI8Dot<F8>) return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
              else return _mm512_loadu_si512(p);
            };
            const __m512i a = words(vrow[2 * tp] + vo + (c0 + w) * 32);
            const __m512i b = LAST ? _mm512_setzero_si512() : words(vrow[2 * tp + 1] + vo + (c0 + w) * 32);
            vlo = _mm512_unpacklo_epi16(a, b);
            vhi = _mm512_unpackhi_epi16(a, b);
          }
          for (int j = 0; j < NH; ++j) {
            lo[w][j] = pv_dot<F8>(lo[w][j], vlo, pw[j]);
            hi[w][j] = pv_dot<F8>(hi[w][j], vhi, pw[j]);
          }
        }
      };
      for (int tp = 0; tp < npairs - (odd ? 1 : 0); ++tp) pair(tp, std::false_type{});
      if (odd) pair(npairs - 1, std::true_type{});
      for (int w = 0; w < CW; ++w)
        for (int j = 0; j < NH; ++j) {
          pv_finish<F8>(acch + j * D + (c0 + w) * 32, lo[w][j], alpha[j], punit[j]);
          pv_finish<F8>(acch + j * D + (c0 + w) * 32 + 16, hi[w][j], alpha[j], punit[j]);
        }
    }
    if (tail) {  // 16 dims: [a0..a15 | b0..b15] -> (a0, b0, a1, b1, ...), natural order
      const __m512i idx = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                            0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                            0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
      PvAcc<F8> a16[NH];
      for (int j = 0; j < NH; ++j) a16[j] = pv_start<F8>(acch + j * D + nc * 32, alpha[j]);
      const auto load16 = [](const CE* p) __attribute__((always_inline)) {
        if constexpr (kI8Dot<F8>) return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        else if constexpr (F8 != kNoF8) return f8_load16<F8>(p);
        else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      };
      for (int tp = 0; tp < npairs; ++tp) {
        const __m256i a = load16(vrow[2 * tp] + vo + nc * 32);
        const __m256i b = (odd && tp == npairs - 1) ? _mm256_setzero_si256() : load16(vrow[2 * tp + 1] + vo + nc * 32);
        const __m512i v = _mm512_permutexvar_epi16(idx, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
        for (int j = 0; j < NH; ++j)
          a16[j] = pv_dot<F8>(a16[j], v, _mm512_set1_epi32(reinterpret_cast<const int32_t*>(p16[j])[tp]));
      }
      for (int j = 0; j < NH; ++j) pv_finish<F8>(acch + j * D + nc * 32, a16[j], alpha[j], punit[j]);
    }
  }
}
#endif

// Where head_dim element d of a decode accumulator row is stored (see attend_span_bf16).
inline int acc_perm_index(int d, int D, bool permuted) {
  if (!permuted || d >= (D / 32) * 32) return d;
  const int c = d / 32, r = d % 32;  // r = 8 q + 4 h + i  ->  lane 16 h + 4 q + i
  return c * 32 + 16 * ((r >> 2) & 1) + 4 * (r >> 3) + (r & 3);
}

template <typename T>
using SpanFn = void (*)(const SpanArgs&, const float*, const T*, float*, float*, V16*, V16*);

// F8: for a one-byte cache (kE5M2 or kE4M3; bf16 queries with vdpbf16ps, bf16 or float32 on AVX2
// builds).
template <typename T, int DT, int F8 = kNoF8>
SpanFn<T> span_fn_d(int nh) {
#if PAGODA_DPBF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    switch (nh) {
      case 1: return attend_span_bf16<1, DT, 0, F8>;
      case 2: return attend_span_bf16<2, DT, 0, F8>;
      case 3: return attend_span_bf16<3, DT, 0, F8>;
      case 4: return attend_span_bf16<4, DT, 0, F8>;
      case 5: return attend_span_bf16<5, DT, 0, F8>;
      case 6: return attend_span_bf16<6, DT, 0, F8>;
      case 7: return attend_span_bf16<7, DT, 0, F8>;
      default: return attend_span_bf16<8, DT, 0, F8>;
    }
  } else  // (attend_span: float32 queries here)
#endif
  {
    switch (nh) {
      case 1: return attend_span<T, 1, DT, F8>;
      case 2: return attend_span<T, 2, DT, F8>;
      case 3: return attend_span<T, 3, DT, F8>;
      case 4: return attend_span<T, 4, DT, F8>;
      case 5: return attend_span<T, 5, DT, F8>;
      case 6: return attend_span<T, 6, DT, F8>;
      case 7: return attend_span<T, 7, DT, F8>;
      default: return attend_span<T, 8, DT, F8>;
    }
  }
}

// The span function for nh heads over nkv kv heads a call; head_dim 64 and 128 get compile-time
// specialisations, and bf16 with head_dim 64 one with the queries in registers for a full group
// (nkv = kMaxGroupHeads / nh).
template <typename T, int F8 = kNoF8>
SpanFn<T> span_fn(int nh, int D, int nkv) {
#if PAGODA_DPBF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    if (D == 64 && nkv == kMaxGroupHeads / nh) {
      switch (nh) {
        case 1: return attend_span_bf16<1, 64, kMaxGroupHeads / 1, F8>;
        case 2: return attend_span_bf16<2, 64, kMaxGroupHeads / 2, F8>;
        case 3: return attend_span_bf16<3, 64, kMaxGroupHeads / 3, F8>;
        case 4: return attend_span_bf16<4, 64, kMaxGroupHeads / 4, F8>;
        case 5: return attend_span_bf16<5, 64, kMaxGroupHeads / 5, F8>;
        case 6: return attend_span_bf16<6, 64, kMaxGroupHeads / 6, F8>;
        case 7: return attend_span_bf16<7, 64, kMaxGroupHeads / 7, F8>;
        case 8: return attend_span_bf16<8, 64, kMaxGroupHeads / 8, F8>;
        default: break;
      }
    }
  }
#else
  (void)nkv;
#endif
  if constexpr (!std::is_same_v<T, f16_t>) {
    if (D == 64) return span_fn_d<T, 64, F8>(nh);
    if (D == 128) return span_fn_d<T, 128, F8>(nh);
  }
  return span_fn_d<T, 0, F8>(nh);
}

template <typename T>
constexpr bool acc_permuted() {
#if PAGODA_DPBF16
  return std::is_same_v<T, bf16_t>;
#else
  return false;
#endif
}

struct Params {
  int B, H, kvh, g, D, block_size, max_blocks;
  int64_t ks0, ks1, ks2, vs0, vs1, vs2, bt_stride;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  float qscale;  // scale * log2(e)
};

// Per-thread scratch for one item covering up to all H heads.
struct Scratch {
  std::vector<float> qf, acc, m, l;
  std::vector<V16> lsum, tmp;
  explicit Scratch(const Params& P)
      : qf(static_cast<size_t>(P.H) * P.D), acc(static_cast<size_t>(P.H) * P.D), m(P.H), l(P.H), lsum(P.H),
        tmp(static_cast<size_t>(P.kvh) * kMaxNH * kSpan) {}
};

// Walks an item's context tokens in order from token t, giving each one's K and V rows (at the
// item's first kv head). A token's block is looked up when the walk reaches it, so a walker may be
// set on any token but must not be advanced past the sequence's last.
template <typename T>
struct RowWalker {
  const Params& P;
  const T* kc;
  const T* vc;
  const int32_t* bt;
  int blk, off;
  const T* kb = nullptr;
  const T* vb = nullptr;

  RowWalker(const Params& P_, const T* kc_, const T* vc_, const int32_t* bt_, int kh0, int t)
      : P(P_), kc(kc_ + kh0 * P_.ks2), vc(vc_ + kh0 * P_.vs2), bt(bt_), blk(t / P_.block_size), off(t % P_.block_size) {}

  // The next n tokens' rows into k[0..n) and v[0..n), a block's run of tokens at a time.
  void fill(const void** k, const void** v, int n) {
    for (int i = 0; i < n;) {
      if (off == P.block_size) {
        off = 0;
        ++blk;
        kb = nullptr;
      }
      if (!kb) {
        kb = kc + bt[blk] * P.ks0;
        vb = vc + bt[blk] * P.vs0;
      }
      const int len = std::min(n - i, P.block_size - off);
      const T* kp = kb + off * P.ks1;
      const T* vp = vb + off * P.vs1;
      for (int j = 0; j < len; ++j) {
        k[i + j] = kp + j * P.ks1;
        v[i + j] = vp + j * P.vs1;
      }
      off += len;
      i += len;
    }
  }
};

// Work item: sequence b, kv heads [kh0, kh1), context tokens [t0, t1). sp < 0: the item covers the
// whole sequence and writes the output directly; else it is slice sp of a split sequence and leaves
// the unnormalized partials (acc, m, l) of each of its kv heads kh in slot part_base[b] + kh * splits[b] + sp.
// nr > 1: rows b .. b + nr - 1 of one sequence, row b + r attending tokens [t0, t1 + r) (run_item).
struct Item {
  int b, nr, kh0, kh1, t0, t1, sp;
};

// The block-table row an item of rows b .. b + nr - 1 walks: the last row's, which covers every
// row's tokens.
inline const int32_t* item_block_table(const Params& P, int b, int nr) {
  return P.block_tables + static_cast<int64_t>(b + nr - 1) * P.bt_stride;
}

// Attend rows b .. b + nr - 1, kv heads [kh0, kh1), context tokens [t0, t1 + r) for row b + r. nr > 1:
// one sequence's consecutive positions (a speculative step's verified tokens, see group_rows),
// whose block-table rows agree over the tokens they share: each span's K/V rows are read from
// memory once, by the first row, and from cache by the others, and every row's arithmetic is what
// an item of that row alone performs (the same spans, in the same order), so the same bits. Leaves
// each row r's unnormalized accumulators in S[r].acc / S[r].m / S[r].l for the (kh1 - kh0) * g
// query heads, in head order.
//
// next (null: none): the item this thread runs next (same kv heads). Once this item's own rows are
// all requested, the prefetch cursor runs on into the next item's first tokens, so the next item
// starts with its rows on the way instead of waiting for them. started: this item's first tokens
// were requested that way by the item before. Returns whether the next item's first `ahead` tokens
// were all requested.
//
// C: the cache element, T's own, f8e5m2_t or f8e4m3_t (vdpbf16ps builds: each row's bf16 queries are
// copied, scaled by 2^112, into its S[r].qf storage, see f8_words; AVX2 builds read the codes' values
// against the float queries as for any cache).
template <typename T, typename C = T>
bool run_item(const Params& P, const T* q, const C* kc, const C* vc, int b, int nr, int kh0, int kh1, int t0,
              int t1, Scratch* S, const Item* next = nullptr, bool started = false) {
  constexpr int F8 = f8_kind<C>();
  const int D = P.D, g = P.g;
  const int nheads = (kh1 - kh0) * g;
  const T* qrows[kMaxGroupRows];
  for (int r = 0; r < nr; ++r) {
    const T* qb = q + (static_cast<int64_t>(b + r) * P.H + static_cast<int64_t>(kh0) * g) * D;
    qrows[r] = qb;  // queries in the storage type (for the bf16 dot-product path)
#if PAGODA_DPBF16
    if constexpr (pagoda::f8_codes(F8) && std::is_same_v<T, bf16_t>) {  // (float32 queries read the codes' values)
      static_assert(acc_permuted<T>(), "vdpbf16ps reads a one-byte cache with bf16 queries");
      bf16_t* qs = reinterpret_cast<bf16_t*>(S[r].qf.data());  // H * D floats: room for H * D bf16
      for (int i = 0; i < nheads * D; ++i) qs[i] = f8_scale_query(qb[i]);
      qrows[r] = qs;
    }
#endif
#if PAGODA_DPBF16
    if constexpr (kI8Dot<F8> && std::is_same_v<T, bf16_t>)  // each head's digits in its float32 query slot
      for (int h = 0; h < nheads; ++h) i8_query_digits(qb + static_cast<size_t>(h) * D, D, S[r].qf.data() + h * D);
#endif
    if constexpr (!acc_permuted<T>())
      for (int i = 0; i < nheads * D; ++i) S[r].qf[i] = to_float(qb[i]);
    std::fill(S[r].acc.begin(), S[r].acc.begin() + static_cast<size_t>(nheads) * D, 0.f);
    std::fill(S[r].m.begin(), S[r].m.begin() + nheads, kNegInf);
    std::fill(S[r].lsum.begin(), S[r].lsum.begin() + nheads, vzero());
  }
  const int t1_first = t1;  // row 0's end; row r ends at t1_first + r
  t1 += nr - 1;  // the last row's end: its block-table row covers every row's tokens

  const int32_t* bt = item_block_table(P, b, nr);
  const int nkv = kh1 - kh0;
  const int64_t elt = sizeof(C);
  // kv heads per span call: the scores of kvg x g heads x kSpan tokens wait in S.tmp for the
  // softmax, so it must stay small (L1).
  const int kvg = std::max(1, std::min(nkv, kMaxGroupHeads / std::min(g, kMaxNH)));
  // (With a one-byte cache, sized as for T's: the spans, and so the bits, are the bf16 cache's.)
  const int span_bytes = kSpan * (kvg * std::min(g, kMaxNH) * 64 + 2 * kvg * D * static_cast<int>(sizeof(T)));
  const int span = span_bytes <= kMaxSpanBytes ? kSpan : kTile;
  // Prefetch: every token's K and V rows are requested into L2 `ahead` tokens (kPrefetchBytes of K
  // and V) before the arithmetic reaches them, by the span call that attends the token `ahead` places
  // earlier, a kv head's part of a row in that kv head's pass, so the requests are spread evenly
  // over the work; the first `ahead` tokens' rows are requested up front. Against a cursor that
  // walked the blocks in address order with a credit counter (the state went through memory on
  // every token, a store to the scores may alias it), SmolLM2 shapes on Zen 4: one core from L2
  // 1.14x; from DRAM (two cores) 0.98-1.08x in isolation and 0.99x over a W run (bench/
  // decode_kernel_ab.py): there the reads, not the bookkeeping, set the pace. Distance: 24 KB beat
  // 8, 16, 32, 48, 64 and 96 KB on short contexts.
  const int64_t head_row = pagoda::cache_head_stride<C>(D);  // a kv head's row (with an int8 row's scale)
  const int run = static_cast<int>(((nkv - 1) * P.ks2 + head_row) * elt);  // bytes of a token's row, item's kv heads
  // At least a span: a call over some of the kv heads must reach past the span it attends (the
  // other kv heads' calls come between). Llama-8B shapes (4 calls a span; `ahead` would be 6 tokens
  // otherwise), one core: 1.44x.
  const int ahead = std::max(span, kPrefetchBytes / (2 * run));
  RowWalker<C> rows(P, kc, vc, bt, kh0, t0), ahead_rows(P, kc, vc, bt, kh0, t0);
  for (int t = t0; t < std::min(t1, t0 + ahead); ++t) {
    const void *k, *v;
    ahead_rows.fill(&k, &v, 1);
    if (!started) {
      prefetch_range_l2(k, run);
      prefetch_range_l2(v, run);
    }
  }
  RowWalker<C> next_rows(P, kc, vc, next ? item_block_table(P, next->b, next->nr) : bt, kh0,
                         next ? next->t0 : 0);
  int next_left = next ? std::max(0, std::min(ahead, next->t1 - next->t0)) : 0;
  const void* krow[kSpan];
  const void* vrow[kSpan];
  SpanFn<T> fns[kMaxNH + 1];  // for a runtime kv-head count
  SpanFn<T> fns_full[kMaxNH + 1];  // for kMaxGroupHeads / nh kv heads
  for (int nh = 1; nh <= std::min(g, kMaxNH); ++nh) {
    fns[nh] = span_fn<T, F8>(nh, D, 0);
    fns_full[nh] = span_fn<T, F8>(nh, D, kMaxGroupHeads / nh);
  }
  const void* krow_g[kSpan];
  const void* vrow_g[kSpan];
  const void* kpf[kSpan];
  const void* vpf[kSpan];
  const void* kpf_g[kSpan];
  const void* vpf_g[kSpan];
  SpanArgs A;
  A.krow = krow;
  A.vrow = vrow;
  A.ks2 = P.ks2;
  A.vs2 = P.vs2;
  A.D = D;
  A.nkv = nkv;
  A.g = g;
  A.qscale = P.qscale;
  // An e4m3 cache's scores come out at 2^-8 of theirs: vdpbf16ps builds read the codes as words of
  // 2^-120 of their values against queries scaled by 2^112, the float32 path at 2^-8 (vload_span).
  if constexpr (F8 == kE4M3) A.qscale = P.qscale * 256.f;
  for (int ts = t0; ts < t1; ts += span) {
    const int n = std::min(span, t1 - ts);
    rows.fill(krow, vrow, n);
    // Row t of kpf / vpf: token ts + t + ahead while that is in the item, then the next item's
    // first tokens, then none.
    const int na = std::clamp(t1 - ahead - ts, 0, n);
    ahead_rows.fill(kpf, vpf, na);
    const int nn = std::min(n - na, next_left);
    next_rows.fill(kpf + na, vpf + na, nn);
    next_left -= nn;
    for (int t = na + nn; t < n; ++t) kpf[t] = vpf[t] = nullptr;
    for (int kg = 0; kg < nkv; kg += kvg) {  // kv heads [kg, kg + A.nkv) of the item
      A.nkv = std::min(kvg, nkv - kg);
      const void* const* kpf_kg = kpf;
      const void* const* vpf_kg = vpf;
      A.krow = krow;
      A.vrow = vrow;
      if (kg > 0) {  // the rows of kv heads kg, ... (the first group's are the walk's own)
        A.krow = krow_g;
        A.vrow = vrow_g;
        kpf_kg = kpf_g;
        vpf_kg = vpf_g;
        for (int t = 0; t < n; ++t) {
          krow_g[t] = static_cast<const C*>(krow[t]) + kg * P.ks2;
          vrow_g[t] = static_cast<const C*>(vrow[t]) + kg * P.vs2;
          kpf_g[t] = kpf[t] ? static_cast<const C*>(kpf[t]) + kg * P.ks2 : nullptr;
          vpf_g[t] = vpf[t] ? static_cast<const C*>(vpf[t]) + kg * P.vs2 : nullptr;
        }
      }
      A.pf_bytes = static_cast<int>(head_row * elt);  // a kv head's part of a row, prefetched by its pass
      bool first = true;  // the first row attending this span prefetches for it
      for (int r = 0; r < nr; ++r) {
        A.n = std::min(span, t1_first + r - ts);  // row r's tokens of the span
        if (A.n <= 0) continue;
        for (int j0 = 0; j0 < g; j0 += kMaxNH) {
          const int nh = std::min(kMaxNH, g - j0);
          A.kpf = first && j0 == 0 ? kpf_kg : nullptr;  // one pass over the kv heads' rows prefetches them
          A.vpf = first && j0 == 0 ? vpf_kg : nullptr;
          const size_t h = static_cast<size_t>(kg) * g + j0;
          const SpanFn<T> fn = A.nkv == kMaxGroupHeads / nh ? fns_full[nh] : fns[nh];
          fn(A, S[r].qf.data() + h * D, qrows[r] + h * D, S[r].acc.data() + h * D, S[r].m.data() + h,
             S[r].lsum.data() + h, S[0].tmp.data());
        }
        first = false;
      }
    }
  }
  for (int r = 0; r < nr; ++r)
    for (int h = 0; h < nheads; ++h) S[r].l[h] = vreduce_add(S[r].lsum[h]);
  return next != nullptr && next_left == 0;
}


// Rows run as one item (run_item): runs of consecutive rows that are one sequence's consecutive
// positions (a speculative step's verified tokens), none split: each row one token longer than the
// row before, its block-table row agreeing with the row before's over that row's blocks (so the
// last row's table reaches every row's tokens). Returns, at each run's first row, the run's length
// (at most kMaxGroupRows), and 0 at the rows inside a run. Rows that only look alike (two sequences
// sharing a cached prefix) attend the same K/V either way: grouping changes the order of the work,
// never a row's arithmetic.
std::vector<int> group_rows(const Params& P, const std::vector<int>& splits) {
  const int B = P.B, bs = P.block_size;
  std::vector<int> group(B, 1);
  auto joins = [&](int b) {  // row b continues row b - 1's sequence
    const int len = P.seq_lens[b - 1];
    if (len <= 0 || P.seq_lens[b] != len + 1 || splits[b - 1] > 1 || splits[b] > 1) return false;
    const int32_t* prev = P.block_tables + static_cast<int64_t>(b - 1) * P.bt_stride;
    const int32_t* cur = P.block_tables + static_cast<int64_t>(b) * P.bt_stride;
    return std::equal(prev, prev + (len + bs - 1) / bs, cur);
  };
  for (int b = 0; b < B;) {
    int e = b + 1;
    while (e < B && e - b < kMaxGroupRows && joins(e)) group[e++] = 0;
    group[b] = e - b;
    b = e;
  }
  return group;
}

template <typename T>
void write_out(const float* acc, const float* l, int nheads, int D, T* ob) {
  constexpr bool perm = acc_permuted<T>();
  for (int h = 0; h < nheads; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    for (int d = 0; d < D; ++d) from_float(acc[h * D + acc_perm_index(d, D, perm)] * inv, ob + h * D + d);
  }
}

template <typename T, typename C = T>
void decode_impl(const Params& P, const T* q, const C* kc, const C* vc, T* out, int nthreads) {
  const int B = P.B, D = P.D, g = P.g, bs = P.block_size, kvh = P.kvh;
  // Items cover all kv heads of a sequence (each block is then read as one contiguous run); with few
  // sequences the context split below makes the parallelism. Measured on Zen 4 (Llama-8B shapes,
  // 2 x 4096, one thread): 1.17x the DRAM throughput of one item per kv head, which the kernel made
  // when there were fewer than 4 sequences per thread.
  const int hpi = kvh;  // kv heads per item
  // A long context is split into block-aligned slices (flash-decoding) whose partial results are
  // merged at the end, in slice order. The slice size depends on the thread count alone, never on
  // the batch, so a row's result depends only on its own context: the same bits in any batch (with
  // other requests or alone, among a speculative step's rows or in a plain decode). 2048 / threads
  // tokens, at least 256: two threads split only contexts over 1024 tokens (never W's).
  constexpr int64_t kMinSliceTokens = 256;
  const int64_t per_slice =  // blocks a slice
      (std::max<int64_t>(kMinSliceTokens, 2048 / std::max(1, nthreads)) + bs - 1) / bs;
  std::vector<int> splits(B, 1);
  std::vector<int64_t> part_base(B, -1);
  int64_t nparts = 0;
  if (nthreads > 1) {
    for (int b = 0; b < B; ++b) {
      const int64_t len = std::max(0, P.seq_lens[b]);
      const int64_t nblk = (len + bs - 1) / bs;
      const int64_t s = (nblk + per_slice - 1) / per_slice;
      if (s > 1) {
        splits[b] = static_cast<int>(s);
        part_base[b] = nparts;
        nparts += s * kvh;
      }
    }
  }
  const std::vector<int> group = group_rows(P, splits);
  const int max_group = *std::max_element(group.begin(), group.end());
  // Longest items first (the dynamic schedule then balances the tail); a sequence's items adjacent.
  std::vector<int> order;
  order.reserve(B);
  for (int b = 0; b < B; ++b)
    if (group[b]) order.push_back(b);
  auto item_len = [&](int b) { return (std::max(0, P.seq_lens[b]) + splits[b] - 1) / splits[b]; };
  if (order.size() > 1)
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return item_len(x) > item_len(y); });
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(B) * (kvh / hpi) + nparts);
  for (int b : order) {
    const int len = std::max(0, P.seq_lens[b]);
    const int nblk = (len + bs - 1) / bs;
    const int per = splits[b] > 1 ? static_cast<int>(per_slice) : nblk;  // blocks per slice
    for (int sp = 0; sp < splits[b]; ++sp)
      for (int kh = 0; kh < kvh; kh += hpi)
        items.push_back({b, group[b], kh, kh + hpi, std::min(len, sp * per * bs), std::min(len, (sp + 1) * per * bs),
                         splits[b] > 1 ? sp : -1});
  }
  std::vector<float> pacc(static_cast<size_t>(nparts) * g * D), pm(static_cast<size_t>(nparts) * g),
      pl(static_cast<size_t>(nparts) * g);
  // Merge tasks: (split sequence, kv head).
  std::vector<std::pair<int, int>> merges;
  for (int b = 0; b < B; ++b)
    if (splits[b] > 1)
      for (int kh = 0; kh < kvh; ++kh) merges.emplace_back(b, kh);

  const int64_t nitems = static_cast<int64_t>(items.size());
  const int64_t nmerges = static_cast<int64_t>(merges.size());
  std::atomic<int64_t> next_item{0};
#pragma omp parallel num_threads(nthreads)
  {
    std::vector<Scratch> SS(max_group, Scratch(P));
    Scratch& S = SS[0];
    // Items are claimed in order, one ahead: a thread knows the item it runs next while it runs
    // one, so run_item can request the next one's first rows (the same claims as a dynamic schedule
    // of one item, each made one item earlier).
    int64_t i = next_item.fetch_add(1, std::memory_order_relaxed);
    bool started = false;
    while (i < nitems) {
      const int64_t i_next = next_item.fetch_add(1, std::memory_order_relaxed);
      const Item& it = items[i];
      const Item* nx = i_next < nitems && items[i_next].t1 > items[i_next].t0 ? &items[i_next] : nullptr;
      const bool was_started = started;
      started = false;
      i = i_next;
      const int nheads = (it.kh1 - it.kh0) * g;
      if (it.sp < 0) {
        T* ob = out + (static_cast<int64_t>(it.b) * P.H + static_cast<int64_t>(it.kh0) * g) * D;
        if (it.t1 <= it.t0) {  // empty sequence: zeros
          for (int e = 0; e < nheads * D; ++e) from_float(0.f, ob + e);
          continue;
        }
        started = run_item<T, C>(P, q, kc, vc, it.b, it.nr, it.kh0, it.kh1, it.t0, it.t1, SS.data(), nx, was_started);
        for (int r = 0; r < it.nr; ++r)
          write_out(SS[r].acc.data(), SS[r].l.data(), nheads, D, ob + static_cast<int64_t>(r) * P.H * D);
        continue;
      }
      const bool empty = it.t1 <= it.t0;  // a trailing slice left empty by the rounding to blocks
      if (!empty)
        started = run_item<T, C>(P, q, kc, vc, it.b, 1, it.kh0, it.kh1, it.t0, it.t1, &S, nx, was_started);
      for (int kh = it.kh0; kh < it.kh1; ++kh) {
        const size_t slot = static_cast<size_t>(part_base[it.b] + static_cast<int64_t>(kh) * splits[it.b] + it.sp);
        const size_t h0 = static_cast<size_t>(kh - it.kh0) * g;
        float* m = pm.data() + slot * g;
        float* l = pl.data() + slot * g;
        if (empty) {
          std::fill(m, m + g, kNegInf);
          std::fill(l, l + g, 0.f);
          continue;
        }
        std::copy(S.m.begin() + h0, S.m.begin() + h0 + g, m);
        std::copy(S.l.begin() + h0, S.l.begin() + h0 + g, l);
        std::copy(S.acc.begin() + h0 * D, S.acc.begin() + (h0 + g) * D, pacc.begin() + slot * g * D);
      }
    }
    // merge the slices of split sequences: out = sum_s w_s acc_s / sum_s w_s l_s
#pragma omp barrier
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nmerges; ++i) {
      const int b = merges[i].first, kh = merges[i].second, ns = splits[b];
      const int64_t base = part_base[b] + static_cast<int64_t>(kh) * ns;
      float* acc = S.acc.data();
      float* l = S.l.data();
      std::fill(acc, acc + static_cast<size_t>(g) * D, 0.f);
      for (int j = 0; j < g; ++j) {
        float mx = kNegInf;
        for (int sp = 0; sp < ns; ++sp) mx = std::max(mx, pm[(base + sp) * g + j]);
        l[j] = 0.f;
        for (int sp = 0; sp < ns; ++sp) {
          const float ms = pm[(base + sp) * g + j];
          if (ms == kNegInf) continue;
          const float w = std::exp2(ms - mx);
          l[j] += w * pl[(base + sp) * g + j];
          const float* a = pacc.data() + ((base + sp) * g + j) * D;
          for (int d = 0; d < D; ++d) acc[j * D + d] += w * a[d];
        }
      }
      write_out(acc, l, g, D, out + (static_cast<int64_t>(b) * P.H + static_cast<int64_t>(kh) * g) * D);
    }
  }
}

// What both entry points require of the caches and of the step's tables (q [., H, D] is checked by
// each for its own layout); the block ids themselves are checked by check_block_ids.
// Whether this build's decode and prefill kernels read a one-byte (float8_e5m2 or float8_e4m3fn)
// cache with queries of this dtype: bf16 with vdpbf16ps (subnormal codes read as zero) or on AVX2
// builds, float32 on AVX-512 and AVX2 builds (the codes widened to float32, every one exactly).
bool decode_supports_f8(at::ScalarType q) {
  return (q == at::kBFloat16 && (PAGODA_DPBF16 || PAGODA_AVX2)) || (q == at::kFloat && (PAGODA_AVX512 || PAGODA_AVX2));
}
bool decode_supports_f8_op(c10::ScalarType q) { return decode_supports_f8(q); }
// Whether this build's decode and prefill kernels read an int8 cache (codes and a scale a row,
// pagoda_cpu.h) with queries of this dtype: where they read a one-byte cache (bf16 with vdpbf16ps
// or on AVX2 builds, float32 on AVX-512 and AVX2 builds; the codes converted exactly).
bool decode_supports_int8(c10::ScalarType q) { return decode_supports_f8(q); }
// Whether they read subnormal codes as zero with queries of this dtype (bf16 on vdpbf16ps builds),
// rather than as their values.
bool decode_f8_flushes_subnormals(c10::ScalarType q) { return q == at::kBFloat16 && PAGODA_DPBF16; }

void check_paged_inputs(const char* name, const at::Tensor& q, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens) {
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              name, ": CPU tensors expected");
  TORCH_CHECK(q.dim() == 3, name, ": q must be 3-d, got ", q.sizes());
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache / value_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), name, ": key_cache and value_cache must share a dtype");
  const bool i8 = key_cache.scalar_type() == at::kChar;
  if (pagoda::coded_dtype(key_cache.scalar_type())) {  // one-byte or int8 codes
    const char* cache = i8 ? "an int8" : key_cache.scalar_type() == at::kFloat8_e5m2 ? "a float8_e5m2" : "a float8_e4m3fn";
    TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, name, ": ", cache,
                " cache takes bfloat16 or float32 q, got ", q.scalar_type());
    TORCH_CHECK(decode_supports_f8(q.scalar_type()), name, ": ", cache, " cache with ", q.scalar_type(),
                " q needs a CPU with AVX512-BF16 (bfloat16 q) or a build for AVX2");
  } else {
    TORCH_CHECK(key_cache.scalar_type() == q.scalar_type(), name,
                ": q and the caches must have the same dtype (or float8_e5m2 / float8_e4m3fn / int8 caches), got ",
                q.scalar_type(), " and ", key_cache.scalar_type());
  }
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "cache head_dim must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables must be [B, max_blocks] int32 with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous [B] int32 tensor");
  const int64_t H = q.size(1), D = q.size(2), kvh = key_cache.size(2);
  if (i8) {
    TORCH_CHECK(key_cache.size(3) == D + pagoda::kRowScaleBytes, name, ": an int8 cache's rows are head_dim (", D,
                ") codes and a float32 scale: last dim ", D + pagoda::kRowScaleBytes, ", got ", key_cache.size(3));
  } else {
    TORCH_CHECK(key_cache.size(3) == D, "head_dim mismatch between q and the cache");
  }
  TORCH_CHECK(D % kTile == 0, "head_dim must be a multiple of ", kTile, ", got ", D);
  TORCH_CHECK(kvh > 0 && H % kvh == 0, "num q heads (", H, ") must be a multiple of num kv heads (", kvh, ")");
  TORCH_CHECK(block_tables.size(0) == seq_lens.size(0), "block_tables / seq_lens batch mismatch");
}

// Every block id the kernels will read: sequence b's first ceil(seq_lens[b] / block_size) entries of
// its block-table row (cheap: B * blocks-per-sequence compares).
void check_block_ids(const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t block_size,
                     int64_t num_blocks) {
  const int64_t B = seq_lens.size(0), max_blocks = block_tables.size(1), stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK(len >= 0 && len <= max_blocks * block_size, "seq_lens[", b, "] = ", len,
                " out of range for a block table of ", max_blocks, " blocks of ", block_size);
    const int32_t* row = bt + b * stride;
    for (int64_t i = 0; i < (len + block_size - 1) / block_size; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "block_tables[", b, ", ", i, "] = ", row[i],
                  " out of range [0, ", num_blocks, ")");
  }
}

void paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor& out, int64_t num_threads) {
  check_paged_inputs("paged_decode_attention", q, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(q.is_contiguous(), "q must be a contiguous [B, H, D] tensor");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous, with q's shape and dtype");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1), kvh = key_cache.size(2);
  TORCH_CHECK(seq_lens.size(0) == B, "block_tables / seq_lens batch mismatch");
  check_block_ids(block_tables, seq_lens, bs, num_blocks);
  if (B == 0) return;

  Params P;
  P.B = static_cast<int>(B);
  P.H = static_cast<int>(H);
  P.kvh = static_cast<int>(kvh);
  P.g = static_cast<int>(H / kvh);
  P.D = static_cast<int>(D);
  P.block_size = static_cast<int>(bs);
  P.max_blocks = static_cast<int>(block_tables.size(1));
  P.ks0 = key_cache.stride(0);
  P.ks1 = key_cache.stride(1);
  P.ks2 = key_cache.stride(2);
  P.vs0 = value_cache.stride(0);
  P.vs1 = value_cache.stride(1);
  P.vs2 = value_cache.stride(2);
  P.bt_stride = block_tables.stride(0);
  P.block_tables = block_tables.data_ptr<int32_t>();
  P.seq_lens = seq_lens.data_ptr<int32_t>();
  P.qscale = static_cast<float>(scale) * kLog2e;

  const int nthreads = static_cast<int>(std::max<int64_t>(1, num_threads > 0 ? num_threads : omp_get_max_threads()));
  // One-byte or int8 codes: q's dtype is one decode_supports_f8 takes (check_paged_inputs).
  if (pagoda::coded_dtype(key_cache.scalar_type())) {
#if PAGODA_AVX512 || PAGODA_AVX2
    pagoda::with_code_element(key_cache.scalar_type(), [&](auto* elem) {
      using C = std::remove_const_t<std::remove_pointer_t<decltype(elem)>>;
      const auto* kc = static_cast<const C*>(key_cache.data_ptr());
      const auto* vc = static_cast<const C*>(value_cache.data_ptr());
      if (q.scalar_type() == at::kFloat) {
        decode_impl<float, C>(P, q.data_ptr<float>(), kc, vc, out.data_ptr<float>(), nthreads);
        return;
      }
#if PAGODA_DPBF16 || PAGODA_AVX2
      decode_impl<bf16_t, C>(P, static_cast<const bf16_t*>(q.data_ptr()), kc, vc,
                             static_cast<bf16_t*>(out.data_ptr()), nthreads);
#endif
    });
#endif
    return;
  }
  switch (q.scalar_type()) {
    case at::kFloat:
      decode_impl<float>(P, q.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                         out.data_ptr<float>(), nthreads);
      break;
    case at::kBFloat16:
      decode_impl<bf16_t>(P, static_cast<const bf16_t*>(q.data_ptr()), static_cast<const bf16_t*>(key_cache.data_ptr()),
                          static_cast<const bf16_t*>(value_cache.data_ptr()), static_cast<bf16_t*>(out.data_ptr()),
                          nthreads);
      break;
    case at::kHalf:
      decode_impl<f16_t>(P, static_cast<const f16_t*>(q.data_ptr()), static_cast<const f16_t*>(key_cache.data_ptr()),
                         static_cast<const f16_t*>(value_cache.data_ptr()), static_cast<f16_t*>(out.data_ptr()),
                         nthreads);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

// ==========================================================================================
// Prefill / chunked prefill (AVX-512 and AVX2 panels; the Python side falls back to torch elsewhere).
// ==========================================================================================
#if PAGODA_AVX512 || PAGODA_AVX2

constexpr int kKeyTile = 64;  // keys per K/V tile: 4 vectors of scores per query row
constexpr int kPanel = 6;     // query rows per register panel (6 x 4 score or output vectors)
constexpr int kAmxRows = 16;  // query rows per AMX panel (a tile's rows)

struct PrefillParams {
  int H, kvh, g, D, bs;
  int64_t qs0, qs1, os0, os1;  // q / out strides (token, head), elements
  int64_t ks0, ks1, ks2, vs0, vs1, vs2;
  int64_t bt_stride;
  const int32_t* block_tables;
  float qscale;  // scale * log2(e)
};

// Query rows [tq0, tq1) x the g q heads of kv head kh, of sequence seq (chunk rows start at q0 in
// q / out; ctx cached tokens precede the chunk).
struct PrefillItem {
  int seq, kh, tq0, tq1, q0, ctx;
  int64_t work;
};

// Storage of one K/V tile and the query rows in the layout the dot products want.
//   bf16: Kp [D/2][64] dwords (head_dim pairs x keys), Vp [32][D] dwords (key pairs x head_dim),
//         Q [rows][D] bf16, P [kPanel][64] bf16
//   fp32: Kp [D][64] floats (head_dim x keys), V read in place, Q [rows][D] floats, P [kPanel][64]
struct PrefillScratch {
  std::vector<float> O, kp, vp, qbuf, m, mnew;
  std::vector<V16> lsum;
  alignas(64) float p[kPanel * kKeyTile];
  alignas(64) float sc[kAmxRows * kKeyTile];      // AMX: a panel's scores
  alignas(64) uint16_t p16[kAmxRows * kKeyTile];  // AMX: its probabilities, bf16
  alignas(64) float opart[kAmxRows * 64];         // AMX: its P @ V for 64 head_dim columns
  const void* vrow[kKeyTile];
  PrefillScratch(int max_rows, int D)
      : O(static_cast<size_t>(max_rows) * D), kp(static_cast<size_t>(D) * kKeyTile),
        vp(static_cast<size_t>(D) * kKeyTile), qbuf(static_cast<size_t>(max_rows) * D), m(max_rows),
        mnew(max_rows + 16), lsum(max_rows) {}
};

#if PAGODA_AVX512
// Query rows as the panels read them: as stored (fp32, or bf16 bits for vdpbf16ps / AMX).
template <typename T>
using PanelQ = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;

// Scores of a panel of R rows against the first 16 NV keys of the packed tile: s[r][v] (16 keys
// each, v < NV; the rest are left alone).
template <typename T, int R, int NV>
PAGODA_INLINE void panel_scores(const void* qrows, int D, const float* kp, __m512 s[R][4]) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) s[r][v] = _mm512_setzero_ps();
#if PAGODA_DPBF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    const int32_t* q = static_cast<const int32_t*>(qrows);  // row r: D/2 dwords at q + r * D / 2
    const int half = D / 2;
    for (int p = 0; p < half; ++p) {
      const float* kr = kp + p * kKeyTile;
      __m512bh k[NV];
      for (int v = 0; v < NV; ++v) k[v] = (__m512bh)_mm512_loadu_ps(kr + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(q[r * half + p]);
        for (int v = 0; v < NV; ++v) s[r][v] = _mm512_dpbf16_ps(s[r][v], k[v], w);
      }
    }
    return;
  }
#endif
  const float* q = static_cast<const float*>(qrows);
  for (int d = 0; d < D; ++d) {
    const float* kr = kp + d * kKeyTile;
    __m512 k[NV];
    for (int v = 0; v < NV; ++v) k[v] = _mm512_loadu_ps(kr + 16 * v);
    for (int r = 0; r < R; ++r) {
      const __m512 w = _mm512_set1_ps(q[r * D + d]);
      for (int v = 0; v < NV; ++v) s[r][v] = _mm512_fmadd_ps(k[v], w, s[r][v]);
    }
  }
}

// O[r][d0 .. d0 + 16 NV) = O * alpha[r] + P[r] @ V for a panel of R rows.
template <typename T, int R, int NV>
PAGODA_INLINE void panel_pv(float* O, int D, int d0, const float* alpha, const float* P, int nk, const float* vp,
                            const void* const* vrow) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(O + r * D + d0 + 16 * v), a);
  }
#if PAGODA_DPBF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    (void)vrow;
    const int32_t* p32 = reinterpret_cast<const int32_t*>(P);  // row r: 32 dwords (key pairs)
    const int nkp = (nk + 1) / 2;
    for (int kp2 = 0; kp2 < nkp; ++kp2) {
      __m512bh vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = (__m512bh)_mm512_loadu_ps(vp + kp2 * D + d0 + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(p32[r * (kKeyTile / 2) + kp2]);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], vv[v], w);
      }
    }
  } else
#endif
  {
    (void)vp;
    for (int k = 0; k < nk; ++k) {
      const float* vr = static_cast<const float*>(vrow[k]) + d0;
      __m512 vv[NV];
      for (int v = 0; v < NV; ++v) vv[v] = _mm512_loadu_ps(vr + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512 w = _mm512_set1_ps(P[r * kKeyTile + k]);
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(vv[v], w, acc[r][v]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(O + r * D + d0 + 16 * v, acc[r][v]);
}

template <typename T, int R>
PAGODA_INLINE void panel_pv_all(float* O, int D, const float* alpha, const float* P, int nk, const float* vp,
                                const void* const* vrow) {
  // 32 head_dim columns a pass (R x 2 accumulators). With 64 (R x 4 = 24 accumulators, 4 V vectors
  // and the broadcast P) gcc 12 spilled an accumulator to the stack and reloaded the V vectors for
  // every row; the second pass reloads P and the tile from L1 instead. Zen 5, SmolLM2 shapes
  // (bench/prefill_kernel_ab.py, bench/RESULTS.md twenty-third session): bf16 1.14-1.33x, fp32
  // 1.04-1.12x; the same output bit for bit.
  int d0 = 0;
  for (; d0 + 32 <= D; d0 += 32) panel_pv<T, R, 2>(O, D, d0, alpha, P, nk, vp, vrow);
  if (d0 < D) panel_pv<T, R, 1>(O, D, d0, alpha, P, nk, vp, vrow);  // D % 32 == 16
}

// Online softmax of a panel, shared by the vector and AMX panels. alpha[r] = 2^(m_old - m_new) for
// the rows in `rows` (m_old = -inf on the first tile: 0; a row that has seen no key yet, m_new =
// -inf, keeps alpha = 1 on its zero accumulators).
PAGODA_INLINE void rescale_factors(const float* m_old, const float* m_new, __mmask16 rows, float* alpha) {
  const __m512 mo = _mm512_maskz_loadu_ps(rows, m_old);
  const __m512 mn = _mm512_maskz_loadu_ps(rows, m_new);
  const __mmask16 seen = _mm512_cmp_ps_mask(mn, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ);
  _mm512_store_ps(alpha, _mm512_mask_blend_ps(seen, _mm512_set1_ps(1.f),
                                              _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(mo, _mm512_set1_ps(kNegInf), _CMP_NEQ_OQ),
                                                                  exp2_ps(_mm512_sub_ps(mo, mn)))));
}

// One row's probabilities over a 64-key tile: e[v] = 2^(s[v] - m_new) in the lanes of mk[v], 0
// elsewhere; lsum = lsum * alpha + their sum.
PAGODA_INLINE void row_probs(const __m512* s, const __mmask16* mk, float m_new, float alpha, V16& lsum, __m512* e) {
  const __m512 negm = _mm512_set1_ps(m_new == kNegInf ? 0.f : -m_new);
  for (int v = 0; v < 4; ++v) e[v] = _mm512_maskz_mov_ps(mk[v], exp2_ps(_mm512_add_ps(s[v], negm)));
  lsum.v = _mm512_fmadd_ps(lsum.v, _mm512_set1_ps(alpha),
                           _mm512_add_ps(_mm512_add_ps(e[0], e[1]), _mm512_add_ps(e[2], e[3])));
}

// ---- AMX (Sapphire Rapids and later): the bf16 panel on tile registers ------------------------
// The packed tile layouts above are already what tdpbf16ps wants: Kp [D/2][64] dwords is the B
// operand of S = Q K^T (rows: head_dim pairs, columns: keys), Vp [32][D] dwords the B operand of
// P @ V (rows: key pairs, columns: head_dim), Q and P rows the A operands. A panel is 16 rows; one
// tdpbf16ps does 16 x 16 x 32 products (vdpbf16ps: 16 x 2), so the dot products cost a fraction of
// what they do on vectors and the softmax between them becomes the larger part.
#if PAGODA_DPBF16 && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PAGODA_AMX 1
#else
#define PAGODA_AMX 0
#endif

std::atomic<bool> g_amx_enabled{true};

#if PAGODA_AMX
// Linux hands a process the tile registers' state only when asked (once; all threads then have it).
bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's eight tiles as 16 rows x 64 bytes (tmm0-3: scores or output partials, tmm4: Q or P
// rows, tmm5-6: K or V pairs). Undone by _tile_release() when the thread's work ends, so the OS
// does not carry the 8 KB tile state through context switches.
void amx_configure() {
  TileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = kAmxRows;
  }
  _tile_loadconfig(&c);
}

// One 16-row panel (row0 .. of the item; Q rows bf16 [16][D], D % 32 == 0) against one packed K/V
// tile: scores on tiles, online softmax on vectors (as prefill_panel), P @ V on tiles, then
// O = O * alpha + P @ V. Keys past the tile's end are zeros in Kp; their P entries are masked to 0.
void prefill_panel_amx(PrefillScratch& S, const uint16_t* qrows, int row0, int D, const int* lim, float qscale) {
  const float* kp = S.kp.data();
  constexpr int kpStride = kKeyTile * 4;  // bytes per Kp row
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int h = 0; h < D / 32; ++h) {
    const float* kh = kp + 16 * h * kKeyTile;
    _tile_loadd(4, qrows + 32 * h, D * 2);
    _tile_loadd(5, kh, kpStride);
    _tile_loadd(6, kh + 16, kpStride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, kh + 32, kpStride);
    _tile_loadd(6, kh + 48, kpStride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_dpbf16ps(3, 4, 6);
  }
  float* sc = S.sc;
  _tile_stored(0, sc, kKeyTile * 4);
  _tile_stored(1, sc + 16, kKeyTile * 4);
  _tile_stored(2, sc + 32, kKeyTile * 4);
  _tile_stored(3, sc + 48, kKeyTile * 4);

  const __m512 vscale = _mm512_set1_ps(qscale);
  __mmask16 mk[kAmxRows][4];
  alignas(64) float mnew[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) {
    __m512 tm = _mm512_set1_ps(kNegInf);
    for (int v = 0; v < 4; ++v) {
      const int n = std::max(0, std::min(16, lim[r] - 16 * v));
      mk[r][v] = lane_mask(n);
      const __m512 x = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), mk[r][v],
                                          _mm512_mul_ps(_mm512_load_ps(sc + r * kKeyTile + 16 * v), vscale));
      _mm512_store_ps(sc + r * kKeyTile + 16 * v, x);
      tm = _mm512_max_ps(tm, x);
    }
    mnew[r] = std::max(S.m[row0 + r], _mm512_reduce_max_ps(tm));
  }
  alignas(64) float alpha[kAmxRows];
  rescale_factors(S.m.data() + row0, mnew, 0xFFFF, alpha);
  std::memcpy(S.m.data() + row0, mnew, sizeof(mnew));
  uint16_t* p16 = S.p16;
  for (int r = 0; r < kAmxRows; ++r) {
    __m512 x[4], e[4];
    for (int v = 0; v < 4; ++v) x[v] = _mm512_load_ps(sc + r * kKeyTile + 16 * v);
    row_probs(x, mk[r], mnew[r], alpha[r], S.lsum[row0 + r], e);
    _mm512_store_si512(p16 + r * kKeyTile, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
    _mm512_store_si512(p16 + r * kKeyTile + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
  }

  // P @ V, 64 head_dim columns (four tiles) at a time.
  const float* vp = S.vp.data();
  float* op = S.opart;
  for (int d0 = 0; d0 < D; d0 += 64) {
    const int nc = std::min(4, (D - d0) / 16);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int h = 0; h < 2; ++h) {  // keys 0-31, 32-63
      const float* vh = vp + 16 * h * D + d0;
      _tile_loadd(4, p16 + 32 * h, kKeyTile * 2);
      _tile_loadd(5, vh, D * 4);
      _tile_dpbf16ps(0, 4, 5);
      if (nc > 1) {
        _tile_loadd(6, vh + 16, D * 4);
        _tile_dpbf16ps(1, 4, 6);
      }
      if (nc > 2) {
        _tile_loadd(5, vh + 32, D * 4);
        _tile_dpbf16ps(2, 4, 5);
      }
      if (nc > 3) {
        _tile_loadd(6, vh + 48, D * 4);
        _tile_dpbf16ps(3, 4, 6);
      }
    }
    _tile_stored(0, op, 64 * 4);
    if (nc > 1) _tile_stored(1, op + 16, 64 * 4);
    if (nc > 2) _tile_stored(2, op + 32, 64 * 4);
    if (nc > 3) _tile_stored(3, op + 48, 64 * 4);
    for (int r = 0; r < kAmxRows; ++r) {
      float* o = S.O.data() + static_cast<size_t>(row0 + r) * D + d0;
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int v = 0; v < nc; ++v)
        _mm512_storeu_ps(o + 16 * v, _mm512_fmadd_ps(_mm512_loadu_ps(o + 16 * v), a, _mm512_load_ps(op + r * 64 + 16 * v)));
    }
  }
}
#endif  // PAGODA_AMX

// One panel of kPanel rows (row0.. of the item) against one K/V tile: scores, online softmax (rows
// whose token sees only part of the tile get lanes past lim[r] masked), P @ V.
template <typename T>
void prefill_panel(PrefillScratch& S, const void* qrows, int row0, int D, int nk, const int* lim, float qscale) {
  // Only the key vectors some row of the panel sees are multiplied (on the causal diagonal a panel
  // sees part of the tile); the others stay -inf and get P = 0.
  int vis = 0;
  for (int r = 0; r < kPanel; ++r) vis = std::max(vis, lim[r]);
  vis = std::min(vis, nk);
  __m512 s[kPanel][4];
  switch ((vis + 15) / 16) {
    case 1: panel_scores<T, kPanel, 1>(qrows, D, S.kp.data(), s); break;
    case 2: panel_scores<T, kPanel, 2>(qrows, D, S.kp.data(), s); break;
    case 3: panel_scores<T, kPanel, 3>(qrows, D, S.kp.data(), s); break;
    default: panel_scores<T, kPanel, 4>(qrows, D, S.kp.data(), s); break;
  }
  const __m512 vscale = _mm512_set1_ps(qscale);
  __mmask16 mk[kPanel][4];
  for (int r = 0; r < kPanel; ++r) {
    for (int v = 0; v < 4; ++v) {
      const int n = std::max(0, std::min(16, lim[r] - 16 * v));
      mk[r][v] = lane_mask(n);
      if (16 * v >= vis) {  // not computed
        s[r][v] = _mm512_set1_ps(kNegInf);
        continue;
      }
      s[r][v] = _mm512_mul_ps(s[r][v], vscale);
      if (n < 16) s[r][v] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), mk[r][v], s[r][v]);
    }
    const float tmax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(s[r][0], s[r][1]), _mm512_max_ps(s[r][2], s[r][3])));
    S.mnew[r] = std::max(S.m[row0 + r], tmax);
  }
  alignas(64) float alpha[16];
  rescale_factors(S.m.data() + row0, S.mnew.data(), lane_mask(kPanel), alpha);
  for (int r = 0; r < kPanel; ++r) {
    S.m[row0 + r] = S.mnew[r];
    __m512 e[4];
    row_probs(s[r], mk[r], S.mnew[r], alpha[r], S.lsum[row0 + r], e);
#if PAGODA_DPBF16
    if constexpr (std::is_same_v<T, bf16_t>) {  // P rounded to bf16 for the P @ V dot products
      uint16_t* p16 = reinterpret_cast<uint16_t*>(S.p) + r * kKeyTile;
      _mm512_storeu_si512(p16, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));
      _mm512_storeu_si512(p16 + 32, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2]));
      continue;
    }
#endif
    for (int v = 0; v < 4; ++v) _mm512_store_ps(S.p + r * kKeyTile + 16 * v, e[v]);
  }
  panel_pv_all<T, kPanel>(S.O.data() + static_cast<size_t>(row0) * D, D, alpha, S.p, vis, S.vp.data(), S.vrow);
}

// In: 16 rows of 16 dwords; out: r[j] lane i = row i's element j.
PAGODA_INLINE void transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // r[i + e], 128-bit lane L: column 4 L + e of rows i .. i + 3
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512 x0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), x1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88), y1 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xDD);
    t[e] = _mm512_shuffle_f32x4(x0, y0, 0x88);
    t[8 + e] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
    t[4 + e] = _mm512_shuffle_f32x4(x1, y1, 0x88);
    t[12 + e] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
  }
  for (int j = 0; j < 16; ++j) r[j] = t[j];
}

// Pack the nk keys at krow / vrow into S.kp (and S.vp / S.vrow): K transposed by 16 x 16 dword
// blocks (a dword: one fp32, or a pair of bf16 head_dim elements); keys past nk are zeros.
template <typename T>
void pack_kv(const PrefillParams& P, const T* const* krow, const T* const* vrow, int nk, PrefillScratch& S) {
  const int D = P.D;
  const int ndw = D * static_cast<int>(sizeof(T)) / 4;  // dwords per K row
  float* kp = S.kp.data();
  for (int kg = 0; kg < kKeyTile; kg += 16) {
    for (int db = 0; db < ndw; db += 16) {
      const int nd = std::min(16, ndw - db);
      const __mmask16 dm = lane_mask(nd);
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = kg + i < nk ? _mm512_maskz_loadu_ps(dm, reinterpret_cast<const float*>(krow[kg + i]) + db)
                           : _mm512_setzero_ps();
      transpose16x16(r);
      for (int j = 0; j < nd; ++j) _mm512_storeu_ps(kp + (db + j) * kKeyTile + kg, r[j]);
    }
  }
#if PAGODA_DPBF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    // V: key pairs interleaved, (v[2i][d], v[2i + 1][d]) per dword, head_dim in natural order.
    const __m512i idx_lo = _mm512_setr_epi32(0x00200000, 0x00210001, 0x00220002, 0x00230003, 0x00240004, 0x00250005,
                                             0x00260006, 0x00270007, 0x00280008, 0x00290009, 0x002A000A, 0x002B000B,
                                             0x002C000C, 0x002D000D, 0x002E000E, 0x002F000F);
    const __m512i idx_hi = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(16));
    float* vp = S.vp.data();
    const int nkp = (nk + 1) / 2;
    for (int i = 0; i < nkp; ++i) {
      const bf16_t* a = vrow[2 * i];
      const bf16_t* b = 2 * i + 1 < nk ? vrow[2 * i + 1] : nullptr;
      float* dst = vp + i * D;
      int c = 0;
      for (; c + 32 <= D; c += 32) {
        const __m512i va = _mm512_loadu_si512(a + c);
        const __m512i vb = b ? _mm512_loadu_si512(b + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(va, idx_lo, vb));
        _mm512_storeu_si512(dst + c + 16, _mm512_permutex2var_epi16(va, idx_hi, vb));
      }
      if (c < D) {  // 16 left
        const __m512i va = _mm512_maskz_loadu_epi16(0xFFFFu, a + c);
        const __m512i vb = b ? _mm512_maskz_loadu_epi16(0xFFFFu, b + c) : _mm512_setzero_si512();
        _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(va, idx_lo, vb));
      }
    }
    return;
  }
#endif
  for (int j = 0; j < nk; ++j) S.vrow[j] = vrow[j];
}

#else  // PAGODA_AVX2
// AVX2 + FMA (Zen 1-3, Intel before Skylake-SP): the same items, tiles and online softmax as the
// AVX-512 panels, on 8-lane vectors and in fp32 throughout (bf16 Q, K and V are widened as they are
// packed; there are no bf16 dot products on these CPUs). 16 ymm registers do not hold a 6 x 64
// panel of scores, so the scores go to S.sc in blocks of 6 rows x 16 keys and the softmax reads
// them back from L1.
#define PAGODA_AMX 0

template <typename T>
using PanelQ = float;

PAGODA_INLINE __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
PAGODA_INLINE __m256 load8(const bf16_t* p) { return bf16x8_to_ps(p); }

// In: 8 rows of 8 dwords; out: r[j] lane i = row i's element j.
PAGODA_INLINE void transpose8x8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {  // per 128-bit half: (r_i, r_i+1) elements 0 1 | 4 5, and 2 3 | 6 7
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {  // u[i + e]: element e (low half) and e + 4 (high half) of rows i .. i + 3
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}

// K transposed into S.kp [D][64] floats by 8 x 8 blocks (keys past nk: zeros); V rows read in
// place (fp32) or widened into S.vp [nk][D] (bf16).
template <typename T>
void pack_kv(const PrefillParams& P, const T* const* krow, const T* const* vrow, int nk, PrefillScratch& S) {
  const int D = P.D;
  float* kp = S.kp.data();
  for (int kg = 0; kg < kKeyTile; kg += 8) {
    for (int d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = kg + i < nk ? load8(krow[kg + i] + d0) : _mm256_setzero_ps();
      transpose8x8(r);
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(kp + (d0 + j) * kKeyTile + kg, r[j]);
    }
  }
  if constexpr (std::is_same_v<T, float>) {
    for (int j = 0; j < nk; ++j) S.vrow[j] = vrow[j];
  } else {
    float* vp = S.vp.data();
    for (int j = 0; j < nk; ++j) {
      float* dst = vp + static_cast<size_t>(j) * D;
      for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, load8(vrow[j] + d));
      S.vrow[j] = dst;
    }
  }
}

// The panel's products in blocks of kPanel rows x 16 columns: 12 accumulators, two vectors of K or
// V and one broadcast fit the 16 registers (3 x 32 blocks need 17: gcc spilled an accumulator to
// the stack in the P @ V loop and ran at half speed). acc[r] += a[r * a_stride + i] * b(i)[0 .. 16)
// over i < n: b(i) is row d of the packed K tile for the scores, the V row of key i for P @ V.
template <typename BRow>
PAGODA_INLINE void panel_update_16(__m256 (&acc)[kPanel][2], const float* a, int a_stride, int n, BRow b) {
  for (int i = 0; i < n; ++i) {
    const float* bi = b(i);
    const __m256 b0 = _mm256_loadu_ps(bi), b1 = _mm256_loadu_ps(bi + 8);
    for (int r = 0; r < kPanel; ++r) {
      const __m256 w = _mm256_broadcast_ss(a + r * a_stride + i);
      acc[r][0] = _mm256_fmadd_ps(b0, w, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(b1, w, acc[r][1]);
    }
  }
}

// Scores of the panel's rows against keys k0 .. k0 + 15 of the packed tile, into sc.
PAGODA_INLINE void panel_scores_16(const float* Q, int D, const float* kp, int k0, float* sc) {
  __m256 acc[kPanel][2];
  for (int r = 0; r < kPanel; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  panel_update_16(acc, Q, D, D, [&](int d) { return kp + d * kKeyTile + k0; });
  for (int r = 0; r < kPanel; ++r) {
    _mm256_storeu_ps(sc + r * kKeyTile + k0, acc[r][0]);
    _mm256_storeu_ps(sc + r * kKeyTile + k0 + 8, acc[r][1]);
  }
}

// O[r][d0 .. d0 + 16) = O * alpha[r] + P[r] @ V for the panel's rows.
PAGODA_INLINE void panel_pv_16(float* O, int D, int d0, const float* alpha, const float* P, int nk,
                               const void* const* vrow) {
  __m256 acc[kPanel][2];
  for (int r = 0; r < kPanel; ++r) {
    const __m256 a = _mm256_set1_ps(alpha[r]);
    acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(O + r * D + d0), a);
    acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(O + r * D + d0 + 8), a);
  }
  panel_update_16(acc, P, kKeyTile, nk, [&](int k) { return static_cast<const float*>(vrow[k]) + d0; });
  for (int r = 0; r < kPanel; ++r) {
    _mm256_storeu_ps(O + r * D + d0, acc[r][0]);
    _mm256_storeu_ps(O + r * D + d0 + 8, acc[r][1]);
  }
}

// One panel of kPanel rows (row0.. of the item) against one K/V tile: scores, online softmax (rows
// whose token sees only part of the tile get keys from lim[r] on masked), P @ V.
template <typename T>
void prefill_panel(PrefillScratch& S, const void* qrows, int row0, int D, int nk, const int* lim, float qscale) {
  const float* Q = static_cast<const float*>(qrows);
  float* sc = S.sc;
  for (int k0 = 0; k0 < kKeyTile; k0 += 16) panel_scores_16(Q, D, S.kp.data(), k0, sc);
  const __m256 vscale = _mm256_set1_ps(qscale), ninf = _mm256_set1_ps(kNegInf);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  alignas(32) float alpha[kPanel];
  int vis = 0;
  for (int r = 0; r < kPanel; ++r) {
    vis = std::max(vis, lim[r]);
    const __m256i lim_v = _mm256_set1_epi32(lim[r]);
    __m256 s[8];
    __m256 mx = ninf;
    for (int v = 0; v < 8; ++v) {
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(lim_v, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * v))));
      s[v] = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(sc + r * kKeyTile + 8 * v), vscale), keep);
      mx = _mm256_max_ps(mx, s[v]);
    }
    const float m_old = S.m[row0 + r];
    const float m_new = std::max(m_old, hmax8(mx));
    // A row that has seen no key yet keeps alpha = 1 on its zero accumulators.
    alpha[r] = m_new == kNegInf ? 1.f : (m_old == kNegInf ? 0.f : std::exp2(m_old - m_new));
    S.m[row0 + r] = m_new;
    const __m256 negm = _mm256_set1_ps(m_new == kNegInf ? 0.f : -m_new);
    __m256 sum = _mm256_setzero_ps();
    for (int v = 0; v < 8; ++v) {
      const __m256 e = exp2_ps(_mm256_add_ps(s[v], negm));  // masked keys: 2^-inf = 0
      _mm256_store_ps(S.p + r * kKeyTile + 8 * v, e);
      sum = _mm256_add_ps(sum, e);
    }
    V16& lsum = S.lsum[row0 + r];  // its high half stays zero
    lsum.lo = _mm256_fmadd_ps(lsum.lo, _mm256_set1_ps(alpha[r]), sum);
  }
  const int nkv = std::min(nk, vis);  // keys past every row's limit have P = 0
  float* O = S.O.data() + static_cast<size_t>(row0) * D;
  for (int d0 = 0; d0 < D; d0 += 16) panel_pv_16(O, D, d0, alpha, S.p, nkv, S.vrow);
}

#endif  // PAGODA_AVX512 panels / PAGODA_AVX2 panels

// Row pointers of keys [k0, k0 + nk) of one sequence (block table row bt) and kv head kh.
template <typename T>
void key_rows(const PrefillParams& P, const T* kc, const T* vc, const int32_t* bt, int kh, int k0, int nk,
              const T** krow, const T** vrow) {
  int blk = k0 / P.bs, off = k0 % P.bs;
  const T* kb = kc + bt[blk] * P.ks0 + kh * P.ks2;
  const T* vb = vc + bt[blk] * P.vs0 + kh * P.vs2;
  for (int j = 0; j < nk; ++j, ++off) {
    if (off == P.bs) {
      off = 0;
      ++blk;
      kb = kc + bt[blk] * P.ks0 + kh * P.ks2;
      vb = vc + bt[blk] * P.vs0 + kh * P.vs2;
    }
    krow[j] = kb + off * P.ks1;
    vrow[j] = vb + off * P.vs1;
  }
}

// Whether this call's bf16 panels run on AMX.
bool use_amx(int D) {
#if PAGODA_AMX
  return D % 32 == 0 && g_amx_enabled.load(std::memory_order_relaxed) && amx_permitted();
#else
  (void)D;
  return false;
#endif
}

// One query row into the panels' layout: copied as it is, or widened to fp32 (AVX2 bf16).
template <typename T, typename QT>
PAGODA_INLINE void copy_q_row(const T* src, QT* dst, int D) {
  if constexpr (sizeof(T) == sizeof(QT)) {
    std::memcpy(dst, src, sizeof(QT) * D);
  } else {
    for (int d = 0; d < D; ++d) dst[d] = to_float(src[d]);
  }
}

// C: the caches' element, T's, f8e5m2_t or f8e4m3_t (each key tile's rows of codes become values of
// T, bf16 or float32 on AVX2, in a staging buffer first, f8_values_row, and the tile is packed from
// there).
template <typename T, typename C = T>
void prefill_item(const PrefillParams& P, const T* q, const C* kc, const C* vc, T* out, const PrefillItem& it,
                  PrefillScratch& S, bool amx) {
  const int D = P.D, g = P.g;
  const int rows = (it.tq1 - it.tq0) * g;
  const int panel = amx ? kAmxRows : kPanel;
  const int rows_p = (rows + panel - 1) / panel * panel;
  // Query rows (token-major, the g heads of the kv head adjacent), padded with zero rows.
  using QT = PanelQ<T>;
  QT* Q = reinterpret_cast<QT*>(S.qbuf.data());
  for (int r = 0; r < rows_p; ++r) {
    QT* dst = Q + static_cast<size_t>(r) * D;
    if (r >= rows) {
      std::memset(dst, 0, sizeof(QT) * D);
      continue;
    }
    const int tok = it.q0 + it.tq0 + r / g;
    const T* src = q + tok * P.qs0 + (it.kh * g + r % g) * P.qs1;
    copy_q_row(src, dst, D);
  }
  std::fill(S.O.begin(), S.O.begin() + static_cast<size_t>(rows_p) * D, 0.f);
  std::fill(S.m.begin(), S.m.begin() + rows_p, kNegInf);
  std::fill(S.lsum.begin(), S.lsum.begin() + rows_p, vzero());

  const int32_t* bt = P.block_tables + static_cast<int64_t>(it.seq) * P.bt_stride;
  const int kend = it.ctx + it.tq1;  // the last row sees keys [0, kend)
  int lim[kAmxRows];
  // Row pointers of this key tile and the next; the next tile's rows are prefetched into L2 a few
  // keys per panel while this one is computed (a long sequence's K/V is not in L2).
  const C* rows_a[2][kKeyTile];
  const C* rows_b[2][kKeyTile];
  const int row_bytes = static_cast<int>(pagoda::cache_head_stride<C>(D) * sizeof(C));  // with an int8 row's scale
  const int npanels = rows_p / panel;
  const int pf_per_panel = (kKeyTile + npanels - 1) / npanels;
  key_rows<C>(P, kc, vc, bt, it.kh, 0, std::min(kKeyTile, kend), rows_a[0], rows_b[0]);
  for (int k0 = 0, cur = 0; k0 < kend; k0 += kKeyTile, cur ^= 1) {
    const int nk = std::min(kKeyTile, kend - k0);
    if constexpr (std::is_same_v<C, T>) {
      pack_kv<T>(P, rows_a[cur], rows_b[cur], nk, S);
    } else {
#if PAGODA_AVX512 || PAGODA_AVX2
      static_assert(f8_kind<C>() != kNoF8, "a cache holds q's dtype or one-byte codes");
      thread_local std::vector<T> stage;
      stage.resize(static_cast<size_t>(2 * kKeyTile) * D);
      const T* ka[kKeyTile];
      const T* va[kKeyTile];
      for (int j = 0; j < nk; ++j) {
        T* k = stage.data() + static_cast<size_t>(j) * D;
        T* v = k + static_cast<size_t>(kKeyTile) * D;
        f8_values_row(rows_a[cur][j], k, D);  // as decode reads them
        f8_values_row(rows_b[cur][j], v, D);
        ka[j] = k;
        va[j] = v;
      }
      pack_kv<T>(P, ka, va, nk, S);
#endif
    }
    if (amx && nk < kKeyTile) {  // the tile's unused key pairs enter P @ V on AMX (times P = 0): zeros
      const int nkp = (nk + 1) / 2;
      std::memset(S.vp.data() + static_cast<size_t>(nkp) * D, 0, sizeof(float) * (kKeyTile / 2 - nkp) * D);
    }
    const int nk_next = std::max(0, std::min(kKeyTile, kend - k0 - kKeyTile));
    if (nk_next) key_rows<C>(P, kc, vc, bt, it.kh, k0 + kKeyTile, nk_next, rows_a[cur ^ 1], rows_b[cur ^ 1]);
    int pf_next = 0;
    for (int row0 = 0; row0 < rows_p; row0 += panel) {
      for (int e = std::min(nk_next, pf_next + pf_per_panel); pf_next < e; ++pf_next) {
        prefetch_row_l2(rows_a[cur ^ 1][pf_next], row_bytes);
        prefetch_row_l2(rows_b[cur ^ 1][pf_next], row_bytes);
      }
      // keys of this tile visible to each row: token t of the chunk sees keys < ctx + t + 1
      int vis_max = 0;
      for (int r = 0; r < panel; ++r) {
        const int row = row0 + r;
        const int tok = row < rows ? it.tq0 + row / g : it.tq1 - 1;  // padding rows: as the last token
        lim[r] = std::min(nk, it.ctx + tok + 1 - k0);
        vis_max = std::max(vis_max, lim[r]);
      }
      if (vis_max <= 0) continue;  // above the diagonal for the whole panel
#if PAGODA_AMX
      if constexpr (std::is_same_v<T, bf16_t>) {
        if (amx) {
          prefill_panel_amx(S, Q + static_cast<size_t>(row0) * D, row0, D, lim, P.qscale);
          continue;
        }
      }
#endif
      prefill_panel<T>(S, Q + static_cast<size_t>(row0) * D, row0, D, nk, lim, P.qscale);
    }
  }
  for (int r = 0; r < rows; ++r) {
    const float l = vreduce_add(S.lsum[r]);
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const int tok = it.q0 + it.tq0 + r / g;
    T* dst = out + tok * P.os0 + (it.kh * g + r % g) * P.os1;
    const float* o = S.O.data() + static_cast<size_t>(r) * D;
    for (int d = 0; d < D; ++d) from_float(o[d] * inv, dst + d);
  }
}

template <typename T, typename C = T>
void prefill_impl(const PrefillParams& P, const T* q, const C* kc, const C* vc, T* out, const int32_t* qstart,
                  const int32_t* seq_lens, int nseq, int nthreads) {
  const int g = P.g;
  // Query tile: ~128 rows (tokens x the kv head's g q heads).
  const int tile_tokens = std::max(8, 128 / g);
  std::vector<PrefillItem> items;
  for (int s = 0; s < nseq; ++s) {
    const int qlen = qstart[s + 1] - qstart[s];
    const int ctx = seq_lens[s] - qlen;
    for (int t0 = 0; t0 < qlen; t0 += tile_tokens) {
      const int t1 = std::min(qlen, t0 + tile_tokens);
      const int64_t work = static_cast<int64_t>(t1 - t0) * (ctx + t1);
      for (int kh = 0; kh < P.kvh; ++kh) items.push_back({s, kh, t0, t1, qstart[s], ctx, work});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const PrefillItem& a, const PrefillItem& b) { return a.work > b.work; });
  const int64_t nitems = static_cast<int64_t>(items.size());
  const bool amx = std::is_same_v<T, bf16_t> && use_amx(P.D);
  const int panel = amx ? kAmxRows : kPanel;
  const int max_rows = (tile_tokens * g + panel - 1) / panel * panel;
#pragma omp parallel num_threads(nthreads)
  {
    PrefillScratch S(max_rows, P.D);
#if PAGODA_AMX
    if (amx) amx_configure();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nitems; ++i) prefill_item<T, C>(P, q, kc, vc, out, items[i], S, amx);
#if PAGODA_AMX
    if (amx) _tile_release();
#endif
  }
}

#endif  // PAGODA_AVX512 || PAGODA_AVX2

bool prefill_supported(at::ScalarType dtype) {
#if PAGODA_AVX512
  if (dtype == at::kFloat) return true;
#if PAGODA_DPBF16
  if (dtype == at::kBFloat16) return true;
#endif
#elif PAGODA_AVX2
  if (dtype == at::kFloat || dtype == at::kBFloat16) return true;
#endif
  (void)dtype;
  return false;
}

void paged_prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                             const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                             const at::Tensor& seq_lens, double scale, at::Tensor& out, int64_t num_threads) {
  check_paged_inputs("paged_prefill_attention", q, key_cache, value_cache, block_tables, seq_lens);
  TORCH_CHECK(prefill_supported(q.scalar_type()), "paged_prefill_attention: dtype ", q.scalar_type(),
              " not supported on this CPU build");
  TORCH_CHECK(q.stride(2) == 1, "q must be [T, H, D] with head_dim contiguous");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(),
              "out must have q's shape and dtype, head_dim contiguous");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.scalar_type() == at::kInt &&
                  query_start_loc.is_contiguous() && query_start_loc.size(0) == seq_lens.size(0) + 1,
              "query_start_loc must be a contiguous [B + 1] int32 tensor");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t B = seq_lens.size(0);
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1), kvh = key_cache.size(2);
  const int32_t* qs = query_start_loc.data_ptr<int32_t>();
  const int32_t* sl = seq_lens.data_ptr<int32_t>();
  const int32_t* btp = block_tables.data_ptr<int32_t>();
  TORCH_CHECK(qs[0] == 0 && qs[B] == T, "query_start_loc must run from 0 to the number of query tokens");
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qlen = qs[b + 1] - qs[b], len = sl[b];
    TORCH_CHECK(qlen >= 0 && len >= qlen, "sequence ", b, ": query length ", qlen, " and seq_len ", len,
                " are inconsistent");
  }
  check_block_ids(block_tables, seq_lens, bs, num_blocks);
  if (T == 0) return;
#if PAGODA_AVX512 || PAGODA_AVX2
  PrefillParams P;
  P.H = static_cast<int>(H);
  P.kvh = static_cast<int>(kvh);
  P.g = static_cast<int>(H / kvh);
  P.D = static_cast<int>(D);
  P.bs = static_cast<int>(bs);
  P.qs0 = q.stride(0);
  P.qs1 = q.stride(1);
  P.os0 = out.stride(0);
  P.os1 = out.stride(1);
  P.ks0 = key_cache.stride(0);
  P.ks1 = key_cache.stride(1);
  P.ks2 = key_cache.stride(2);
  P.vs0 = value_cache.stride(0);
  P.vs1 = value_cache.stride(1);
  P.vs2 = value_cache.stride(2);
  P.bt_stride = block_tables.stride(0);
  P.block_tables = btp;
  P.qscale = static_cast<float>(scale) * kLog2e;
  const int nthreads = static_cast<int>(std::max<int64_t>(1, num_threads > 0 ? num_threads : omp_get_max_threads()));
  if (pagoda::coded_dtype(key_cache.scalar_type())) {  // one-byte or int8 codes, q a dtype decode_supports_f8 takes
    pagoda::with_code_element(key_cache.scalar_type(), [&](auto* elem) {
      using C = std::remove_const_t<std::remove_pointer_t<decltype(elem)>>;
      const auto* kc = static_cast<const C*>(key_cache.data_ptr());
      const auto* vc = static_cast<const C*>(value_cache.data_ptr());
      if (q.scalar_type() == at::kFloat) {
        prefill_impl<float, C>(P, q.data_ptr<float>(), kc, vc, out.data_ptr<float>(), qs, sl, static_cast<int>(B),
                               nthreads);
        return;
      }
#if PAGODA_DPBF16 || PAGODA_AVX2
      prefill_impl<bf16_t, C>(P, static_cast<const bf16_t*>(q.data_ptr()), kc, vc,
                              static_cast<bf16_t*>(out.data_ptr()), qs, sl, static_cast<int>(B), nthreads);
#endif
    });
  } else if (q.scalar_type() == at::kFloat) {
    prefill_impl<float>(P, q.data_ptr<float>(), key_cache.data_ptr<float>(), value_cache.data_ptr<float>(),
                        out.data_ptr<float>(), qs, sl, static_cast<int>(B), nthreads);
  } else {
    prefill_impl<bf16_t>(P, static_cast<const bf16_t*>(q.data_ptr()), static_cast<const bf16_t*>(key_cache.data_ptr()),
                         static_cast<const bf16_t*>(value_cache.data_ptr()), static_cast<bf16_t*>(out.data_ptr()), qs,
                         sl, static_cast<int>(B), nthreads);
  }
#endif
}

bool prefill_supports(c10::ScalarType dtype) { return prefill_supported(dtype); }

bool has_avx512() { return PAGODA_AVX512; }

// Turn the AMX prefill panels on or off (tests run both); returns whether bf16 prefill now uses AMX
// (head_dim a multiple of 32).
bool set_prefill_amx(bool enabled) {
#if PAGODA_AVX512
  g_amx_enabled.store(enabled);
  return use_amx(32);
#else
  (void)enabled;
  return false;
#endif
}

}  // namespace

namespace pagoda {

void decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor& out,
                      int64_t num_threads) {
  paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, out, num_threads);
}

void prefill_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const at::Tensor& block_tables, const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                       double scale, at::Tensor& out, int64_t num_threads) {
  paged_prefill_attention(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale, out, num_threads);
}

}  // namespace pagoda

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor(a!) out, int num_threads) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("has_avx512() -> bool", TORCH_FN(has_avx512));
  m.def("decode_supports_f8(ScalarType q) -> bool", TORCH_FN(decode_supports_f8_op));
  m.def("decode_f8_flushes_subnormals(ScalarType q) -> bool", TORCH_FN(decode_f8_flushes_subnormals));
  m.def("decode_supports_int8(ScalarType q) -> bool", TORCH_FN(decode_supports_int8));
  m.def(
      "paged_prefill_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor seq_lens, float scale, Tensor(a!) out, int num_threads) -> ()");
  m.impl("paged_prefill_attention", c10::DispatchKey::CPU, TORCH_FN(paged_prefill_attention));
  m.def("prefill_supports(ScalarType dtype) -> bool", TORCH_FN(prefill_supports));
  m.def("set_prefill_amx(bool enabled) -> bool", TORCH_FN(set_prefill_amx));
}
