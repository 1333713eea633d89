// Paged DECODE attention for the CPU: reads K/V straight through the block table (no gather).
//
// Layout (per layer): key_cache / value_cache [num_blocks, block_size, num_kv_heads, head_dim]
// (the last dim must be contiguous; the other strides are free), q / out [B, H, D] contiguous,
// block_tables [B, max_blocks] int32 (rows may be strided), seq_lens [B] int32.
//
// Work is split into items (sequence, all kv heads or one[, context slice]) run by OpenMP with a
// dynamic schedule, longest first. An item walks its sequence's blocks (software-prefetching ahead, since
// blocks are scattered) and processes the g = H / kvh query heads sharing a kv head together,
// so each K/V row is loaded from memory once for all of them: 16-token tiles, online softmax
// (running max / sum), fp32 accumulators. A sequence much longer than the average work per
// thread (few sequences, or one long one among short ones) is split into block-aligned slices
// (flash-decoding) whose partial results are merged at the end.
//
// Built at first use by pagoda_kernels/cpu_attention.py with -O3 -march=native -fopenmp. Only
// light torch headers are included (no pybind11, no ATen operators) so the build takes seconds.
// The AVX-512 path is used when the compiler targets it; otherwise a portable 16-lane fallback
// that gcc auto-vectorizes for whatever the target offers.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define PAGODA_AVX512 1
#else
#define PAGODA_AVX512 0
#endif

namespace {

constexpr int kTile = 16;    // tokens per tile == lanes per vector
constexpr int kMaxNH = 8;    // query heads processed together per pass over a tile
constexpr int kPrefetchBlocks = 2;  // software prefetch distance, in blocks
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Storage tags for the 16-bit types (raw bits).
struct bf16_t { uint16_t x; };
struct f16_t { uint16_t x; };

inline float to_float(float v) { return v; }
inline float to_float(bf16_t v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(f16_t v) { return static_cast<float>(c10::Half(v.x, c10::Half::from_bits())); }

inline void from_float(float f, float* dst) { *dst = f; }
inline void from_float(float f, bf16_t* dst) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) {
    dst->x = 0x7FC0;
    return;
  }
  u += 0x7FFFu + ((u >> 16) & 1u);
  dst->x = static_cast<uint16_t>(u >> 16);
}
inline void from_float(float f, f16_t* dst) { dst->x = c10::Half(f).x; }

// ------------------------------------------------------------------------------------------
// 16-lane float vector: AVX-512 or portable.
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
inline void vstore(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 vfma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 vmul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline float vreduce_max(V16 a) { return _mm512_reduce_max_ps(a.v); }
inline float vreduce_add(V16 a) { return _mm512_reduce_add_ps(a.v); }
inline __mmask16 lane_mask(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
// Lanes >= n become -inf.
inline V16 vmask_ninf(V16 a, int n) { return {_mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), lane_mask(n), a.v)}; }
// 2^x for x <= 0 (x = -inf allowed; lanes >= n forced to 0).
inline V16 vexp2_masked(V16 a, int n) {
  __m512 x = _mm512_max_ps(a.v, _mm512_set1_ps(-127.f));
  __m512 k = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, k);  // [-0.5, 0.5]
  // 2^r = e^(r ln2), Taylor to degree 7 (rel. error ~5e-9 on [-0.5, 0.5]).
  __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.5403530393381606e-04f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3333558146428441e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291076284772e-03f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504108664821580e-02f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(2.4022650695910071e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(6.9314718055994531e-01f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return {_mm512_maskz_mov_ps(lane_mask(n), _mm512_scalef_ps(p, k))};
}
// out lane t = sum of the 16 lanes of a[t]  (transpose-and-add tree, 15 adds + 31 shuffles).
inline V16 hsum16(const V16* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // low 256 bits: token i, high: token i + 8
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[i].v, a[i + 8].v, 0x44),
                         _mm512_shuffle_f32x4(a[i].v, a[i + 8].v, 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit chunks: tokens i, i+8, i+4, i+12
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[i], b[i + 4], 0x88),
                         _mm512_shuffle_f32x4(b[i], b[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[i], c[i + 2], 0x44), _mm512_shuffle_ps(c[i], c[i + 2], 0xEE));
  __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
  // e holds tokens in lane order 0,2,1,3,8,10,9,11,4,6,5,7,12,14,13,15 (an involution).
  const __m512i idx = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return {_mm512_permutexvar_ps(idx, e)};
}
inline void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); }

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
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

#endif

template <typename T>
inline void prefetch_row(const T* row, int D) {
  constexpr int line = 64 / static_cast<int>(sizeof(T));
  for (int e = 0; e < D; e += line) prefetch(row + e);
}

#if PAGODA_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGODA_DPBF16 1
// bf16 scores with vdpbf16ps: 32 bf16 products per instruction straight from the cache rows (no
// conversion; bf16 x bf16 products are exact in fp32). qraw: the unscaled bf16 queries [NH][D].
template <int NH>
inline void score_rows_bf16(const bf16_t* const* krow, int n, int D, const bf16_t* qraw, V16* tmp,
                            const bf16_t* const* pk) {
  const int nc = D / 32;
  const bool tail = (D % 32) != 0;  // D % 32 == 16: one half-width chunk
  for (int t = 0; t < n; ++t) {
    if (pk) prefetch_row(pk[t], D);
    __m512 part[NH];
    for (int j = 0; j < NH; ++j) part[j] = _mm512_setzero_ps();
    const bf16_t* kp = krow[t];
    for (int c = 0; c < nc; ++c) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kp + c * 32);
      for (int j = 0; j < NH; ++j)
        part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)_mm512_loadu_si512(qraw + j * D + c * 32), kv);
    }
    if (tail) {
      const __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, kp + nc * 32);
      for (int j = 0; j < NH; ++j)
        part[j] = _mm512_dpbf16_ps(part[j], (__m512bh)_mm512_maskz_loadu_epi16(0xFFFFu, qraw + j * D + nc * 32), kv);
    }
    for (int j = 0; j < NH; ++j) tmp[j * kTile + t].v = part[j];
  }
}
#else
#define PAGODA_DPBF16 0
#endif

// ------------------------------------------------------------------------------------------
// One 16-token tile for NH query heads sharing one kv head.
//   krow/vrow[t]: the K/V row (head_dim elements) of token t of the tile, t < n
//   qf  [NH][D]: queries as fp32 (qraw: the same in the storage type); qscale = scale * log2(e)
//   (scores are kept in the log2 domain)
//   acc [NH][D]: unnormalized output accumulators; m/l [NH]: running max / sum
//   tmp: scratch of NH * 16 vectors
//   pk/pv: rows of a block further ahead to software-prefetch, one K and one V row per token as
//   the tile goes (spread out so the prefetches overlap the math), or null
// ------------------------------------------------------------------------------------------
template <typename T, int NH>
void attend_tile(const T* const* krow, const T* const* vrow, int n, int D, const float* qf, const T* qraw,
                 float qscale, float* acc, float* m, float* l, V16* tmp, const T* const* pk, const T* const* pv) {
  const int nc = D / kTile;
  // Scores: per token, NH lane-partial dot products, then one transpose-add tree per head.
#if PAGODA_DPBF16
  if constexpr (std::is_same_v<T, bf16_t>) {
    score_rows_bf16<NH>(krow, n, D, qraw, tmp, pk);
  } else
#endif
  {
    (void)qraw;
    for (int t = 0; t < n; ++t) {
      if (pk) prefetch_row(pk[t], D);
      V16 part[NH];
      for (int j = 0; j < NH; ++j) part[j] = vzero();
      const T* kp = krow[t];
      for (int c = 0; c < nc; ++c) {
        V16 kv = vload(kp + c * kTile);
        for (int j = 0; j < NH; ++j) part[j] = vfma(vload(qf + j * D + c * kTile), kv, part[j]);
      }
      for (int j = 0; j < NH; ++j) tmp[j * kTile + t] = part[j];
    }
  }
  for (int t = n; t < kTile; ++t)
    for (int j = 0; j < NH; ++j) tmp[j * kTile + t] = vzero();

  float p[NH][kTile];
  float alpha[NH];
  const V16 vscale = vset1(qscale);
  for (int j = 0; j < NH; ++j) {
    V16 s = vmask_ninf(vmul(hsum16(tmp + j * kTile), vscale), n);
    const float m_new = std::max(m[j], vreduce_max(s));
    alpha[j] = std::exp2(m[j] - m_new);  // 0 on the first tile (m = -inf)
    V16 e = vexp2_masked(vfma(vset1(1.f), s, vset1(-m_new)), n);
    l[j] = l[j] * alpha[j] + vreduce_add(e);
    m[j] = m_new;
    vstore(p[j], e);
  }
  // acc = acc * alpha + P @ V, one 16-wide column chunk at a time (NH accumulators in registers).
  for (int c = 0; c < nc; ++c) {
    V16 a[NH];
    for (int j = 0; j < NH; ++j) a[j] = vmul(vload(acc + j * D + c * kTile), vset1(alpha[j]));
    for (int t = 0; t < n; ++t) {
      if (c == 0 && pv) prefetch_row(pv[t], D);
      V16 vv = vload(vrow[t] + c * kTile);
      for (int j = 0; j < NH; ++j) a[j] = vfma(vset1(p[j][t]), vv, a[j]);
    }
    for (int j = 0; j < NH; ++j) vstore(acc + j * D + c * kTile, a[j]);
  }
}

template <typename T>
using TileFn = void (*)(const T* const*, const T* const*, int, int, const float*, const T*, float, float*, float*,
                        float*, V16*, const T* const*, const T* const*);

template <typename T>
TileFn<T> tile_fn(int nh) {
  switch (nh) {
    case 1: return attend_tile<T, 1>;
    case 2: return attend_tile<T, 2>;
    case 3: return attend_tile<T, 3>;
    case 4: return attend_tile<T, 4>;
    case 5: return attend_tile<T, 5>;
    case 6: return attend_tile<T, 6>;
    case 7: return attend_tile<T, 7>;
    default: return attend_tile<T, 8>;
  }
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
  std::vector<V16> tmp;
  explicit Scratch(const Params& P)
      : qf(static_cast<size_t>(P.H) * P.D), acc(static_cast<size_t>(P.H) * P.D), m(P.H), l(P.H),
        tmp(static_cast<size_t>(kMaxNH) * kTile) {}
};

// Attend sequence b, kv heads [kh0, kh1), context tokens [t0, t1). Leaves the unnormalized
// accumulators in S.acc / S.m / S.l for the (kh1 - kh0) * g query heads, in head order.
template <typename T>
void run_item(const Params& P, const T* q, const T* kc, const T* vc, int b, int kh0, int kh1, int t0, int t1,
              Scratch& S) {
  const int D = P.D, g = P.g, bs = P.block_size;
  const int nheads = (kh1 - kh0) * g;
  const T* qb = q + (static_cast<int64_t>(b) * P.H + static_cast<int64_t>(kh0) * g) * D;
  for (int i = 0; i < nheads * D; ++i) S.qf[i] = to_float(qb[i]);
  const T* qraw = qb;  // queries in the storage type (for the bf16 dot-product path)
  std::fill(S.acc.begin(), S.acc.begin() + static_cast<size_t>(nheads) * D, 0.f);
  std::fill(S.m.begin(), S.m.begin() + nheads, kNegInf);
  std::fill(S.l.begin(), S.l.begin() + nheads, 0.f);

  const int32_t* bt = P.block_tables + static_cast<int64_t>(b) * P.bt_stride;
  const T* krow[kTile];
  const T* vrow[kTile];
  const T* pkrow[kTile];
  const T* pvrow[kTile];
  const int first_blk = t0 / bs, last_blk = (t1 - 1) / bs;
  // Blocks sit at random places, out of reach of the hardware prefetchers: the tile code
  // software-prefetches the same rows of the block kPrefetchBlocks ahead, a row per token, so the
  // prefetches spread over the math instead of stalling in a burst (measured 2-2.5x the DRAM
  // throughput of prefetching a whole block at once on Zen 4).

  for (int blk = first_blk; blk <= last_blk; ++blk) {
    const int64_t phys = bt[blk];
    const T* kblk = kc + phys * P.ks0;
    const T* vblk = vc + phys * P.vs0;
    const bool pf = blk + kPrefetchBlocks <= last_blk;
    const int64_t pphys = pf ? bt[blk + kPrefetchBlocks] : 0;
    const T* pkblk = kc + pphys * P.ks0;
    const T* pvblk = vc + pphys * P.vs0;
    const int lo = std::max(t0, blk * bs) - blk * bs;
    const int hi = std::min(t1, (blk + 1) * bs) - blk * bs;
    for (int ts = lo; ts < hi; ts += kTile) {
      const int n = std::min(kTile, hi - ts);
      for (int kh = kh0; kh < kh1; ++kh) {
        for (int t = 0; t < n; ++t) {
          krow[t] = kblk + (ts + t) * P.ks1 + kh * P.ks2;
          vrow[t] = vblk + (ts + t) * P.vs1 + kh * P.vs2;
        }
        if (pf)
          for (int t = 0; t < n; ++t) {
            pkrow[t] = pkblk + (ts + t) * P.ks1 + kh * P.ks2;
            pvrow[t] = pvblk + (ts + t) * P.vs1 + kh * P.vs2;
          }
        const int hbase = (kh - kh0) * g;
        for (int j0 = 0; j0 < g; j0 += kMaxNH) {
          const int nh = std::min(kMaxNH, g - j0);
          const int h = hbase + j0;
          tile_fn<T>(nh)(krow, vrow, n, D, S.qf.data() + static_cast<size_t>(h) * D, qraw + static_cast<size_t>(h) * D,
                         P.qscale, S.acc.data() + static_cast<size_t>(h) * D, S.m.data() + h, S.l.data() + h, S.tmp.data(),
                         pf && j0 == 0 ? pkrow : nullptr, pf && j0 == 0 ? pvrow : nullptr);
        }
      }
    }
  }
}

// Work item: sequence b, kv heads [kh0, kh1), context tokens [t0, t1). sp < 0: the item covers the
// whole sequence and writes the output directly; else it is slice sp of a split sequence and leaves
// the unnormalized partials (acc, m, l) of each of its kv heads kh in slot part_base[b] + kh * splits[b] + sp.
struct Item {
  int b, kh0, kh1, t0, t1, sp;
};

template <typename T>
void write_out(const float* acc, const float* l, int nheads, int D, T* ob) {
  for (int h = 0; h < nheads; ++h) {
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    for (int d = 0; d < D; ++d) from_float(acc[h * D + d] * inv, ob + h * D + d);
  }
}

template <typename T>
void decode_impl(const Params& P, const T* q, const T* kc, const T* vc, T* out, int nthreads) {
  const int B = P.B, D = P.D, g = P.g, bs = P.block_size, kvh = P.kvh;
  // Items cover all kv heads of a sequence when there are enough sequences to keep the threads
  // busy (each block is then read as one contiguous run: ~1.2-1.6x the DRAM throughput of
  // per-head items in A/B runs here), else one kv head each.
  const int hpi = (B >= 4 * nthreads) ? kvh : 1;  // kv heads per item
  // A sequence much longer than the average work per item-thread (few sequences, or one long one
  // among short ones) is split into block-aligned slices (flash-decoding), merged at the end.
  int64_t total = 0;
  for (int b = 0; b < B; ++b) total += std::max(0, P.seq_lens[b]);
  total *= kvh;  // work in token x kv-head units
  constexpr int64_t kMinSliceTokens = 256;
  const int64_t target = std::max(kMinSliceTokens * hpi, total / (4 * static_cast<int64_t>(nthreads)));
  std::vector<int> splits(B, 1);
  std::vector<int64_t> part_base(B, -1);
  int64_t nparts = 0;
  if (nthreads > 1) {
    for (int b = 0; b < B; ++b) {
      const int64_t len = std::max(0, P.seq_lens[b]);
      const int64_t nblk = (len + bs - 1) / bs;
      const int64_t s = std::min<int64_t>(nblk, (len * hpi + target - 1) / target);
      if (s > 1) {
        splits[b] = static_cast<int>(s);
        part_base[b] = nparts;
        nparts += s * kvh;
      }
    }
  }
  // Longest items first (the dynamic schedule then balances the tail); a sequence's items adjacent.
  std::vector<int> order(B);
  for (int b = 0; b < B; ++b) order[b] = b;
  auto item_len = [&](int b) { return (std::max(0, P.seq_lens[b]) + splits[b] - 1) / splits[b]; };
  if (B > 1) std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return item_len(x) > item_len(y); });
  std::vector<Item> items;
  items.reserve(static_cast<size_t>(B) * (kvh / hpi) + nparts);
  for (int b : order) {
    const int len = std::max(0, P.seq_lens[b]);
    const int nblk = (len + bs - 1) / bs;
    const int per = (nblk + splits[b] - 1) / splits[b];  // blocks per slice
    for (int sp = 0; sp < splits[b]; ++sp)
      for (int kh = 0; kh < kvh; kh += hpi)
        items.push_back({b, kh, kh + hpi, std::min(len, sp * per * bs), std::min(len, (sp + 1) * per * bs),
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
#pragma omp parallel num_threads(nthreads)
  {
    Scratch S(P);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < nitems; ++i) {
      const Item& it = items[i];
      const int nheads = (it.kh1 - it.kh0) * g;
      if (it.sp < 0) {
        T* ob = out + (static_cast<int64_t>(it.b) * P.H + static_cast<int64_t>(it.kh0) * g) * D;
        if (it.t1 <= it.t0) {  // empty sequence: zeros
          for (int e = 0; e < nheads * D; ++e) from_float(0.f, ob + e);
          continue;
        }
        run_item<T>(P, q, kc, vc, it.b, it.kh0, it.kh1, it.t0, it.t1, S);
        write_out(S.acc.data(), S.l.data(), nheads, D, ob);
        continue;
      }
      const bool empty = it.t1 <= it.t0;  // a trailing slice left empty by the rounding to blocks
      if (!empty) run_item<T>(P, q, kc, vc, it.b, it.kh0, it.kh1, it.t0, it.t1, S);
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
    // (implicit barrier) merge the slices of split sequences: out = sum_s w_s acc_s / sum_s w_s l_s
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

void paged_decode_attention(const at::Tensor& q, const at::Tensor& key_cache, const at::Tensor& value_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                            at::Tensor& out, int64_t num_threads) {
  TORCH_CHECK(q.device().is_cpu() && key_cache.device().is_cpu() && value_cache.device().is_cpu(),
              "paged_decode_attention: CPU tensors expected");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a contiguous [B, H, D] tensor");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous, with q's shape and dtype");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache / value_cache must be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.scalar_type() == q.scalar_type() && value_cache.scalar_type() == q.scalar_type(),
              "q and the caches must have the same dtype");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1, "cache head_dim must be contiguous");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "block_tables must be [B, max_blocks] int32 with contiguous rows");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "seq_lens must be a contiguous [B] int32 tensor");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = key_cache.size(0), bs = key_cache.size(1), kvh = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D, "head_dim mismatch between q and the cache");
  TORCH_CHECK(D % kTile == 0, "head_dim must be a multiple of 16, got ", D);
  TORCH_CHECK(kvh > 0 && H % kvh == 0, "num q heads (", H, ") must be a multiple of num kv heads (", kvh, ")");
  TORCH_CHECK(block_tables.size(0) == B && seq_lens.size(0) == B, "block_tables / seq_lens batch mismatch");
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

  // Validate every block id the kernel will read (cheap: B * blocks-per-sequence compares).
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = P.seq_lens[b];
    TORCH_CHECK(len >= 0 && len <= static_cast<int64_t>(P.max_blocks) * bs, "seq_lens[", b, "] = ", len,
                " out of range for a block table of ", P.max_blocks, " blocks of ", bs);
    const int32_t* row = P.block_tables + b * P.bt_stride;
    for (int64_t i = 0; i < (len + bs - 1) / bs; ++i)
      TORCH_CHECK(row[i] >= 0 && row[i] < num_blocks, "block_tables[", b, ", ", i, "] = ", row[i],
                  " out of range [0, ", num_blocks, ")");
  }

  const int nthreads = static_cast<int>(std::max<int64_t>(1, num_threads > 0 ? num_threads : omp_get_max_threads()));
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

bool has_avx512() { return PAGODA_AVX512; }

}  // namespace

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def(
      "paged_decode_attention(Tensor q, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, float scale, Tensor(a!) out, int num_threads) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.def("has_avx512() -> bool", TORCH_FN(has_avx512));
}
