"""Whether a hand-written AMX micro-kernel beats torch's cpublas::brgemm at SmolLM2's GEMM shapes.

    python bench/amx_kernel_probe.py [--rows 256,2048] [--reps 9]

On a CPU with AMX-BF16 only. One thread. For each of the layer's four weights (QKV 960 x 576,
o_proj 576 x 576, gate/up 3072 x 576, down 576 x 1536), packed per 64-column block as the engine
packs it (cpublas::pack: [N/64][K/2][64][2]), each 256-row slice of x is multiplied block by block
into a 256 x 64 float32 buffer and copied out, as the engine's AMX path does, by:
  - brgemm: at::native::cpublas::brgemm(rows, 64, K) per block (the engine's call);
  - tiles 2x2: our own tile loop, C as 2 x 2 tiles of 16 x 16 (32 rows x 32 columns), whole K,
    the tile loads interleaved with the products;
  - tiles 2x2, K in chunks of 288: the same, each chunk of a block's K (the last one shorter where
    K is not a multiple) over all the slice's rows before the next (C stored and reloaded between chunks: the same float32 sums, in the same order).
Prints GFLOP/s of brgemm (time-stamp counter cycles at the measured counter rate) and each
variant's speed relative to it, with the weight hot (one block reused) and cycled (every block),
and whether each variant's output has brgemm's bits. Then the gate/up epilogue's silu on this host,
cycles per 16 outputs: the engine's bf16 table gather against Sleef's exp and a division.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <x86intrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <cstring>
#include <vector>

struct alignas(64) TileCfg { uint8_t palette, start; uint8_t rsv[14]; uint16_t colsb[16]; uint8_t rows[16]; };

static void tiles16() {
  TileCfg t;
  std::memset(&t, 0, sizeof t);
  t.palette = 1;
  for (int i = 0; i < 8; ++i) { t.rows[i] = 16; t.colsb[i] = 64; }
  _tile_loadconfig(&t);
}

// c[rows][64] (+)= a[rows][k0..k1) * b[k0..k1) for a 64-column block b [K/2][64][2]; rows % 32 == 0.
static void tiles_2x2(int64_t rows, int64_t k0, int64_t k1, const uint16_t* a, int64_t lda, const uint16_t* b,
                      float* c) {
  for (int64_t r = 0; r < rows; r += 32)
    for (int64_t j = 0; j < 64; j += 32) {
      float* c0 = c + r * 64 + j;
      float* c1 = c0 + 16 * 64;
      if (k0 == 0) {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      } else {
        _tile_loadd(0, c0, 256); _tile_loadd(1, c0 + 16, 256); _tile_loadd(2, c1, 256); _tile_loadd(3, c1 + 16, 256);
      }
      for (int64_t kk = k0; kk < k1; kk += 32) {
        _tile_loadd(4, a + r * lda + kk, lda * 2);
        _tile_loadd(6, b + kk * 64 + j * 2, 256);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + kk * 64 + (j + 16) * 2, 256);
        _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a + (r + 16) * lda + kk, lda * 2);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, c0, 256); _tile_stored(1, c0 + 16, 256); _tile_stored(2, c1, 256); _tile_stored(3, c1 + 16, 256);
    }
}

// mode 0 brgemm, 1 tiles 2x2 whole K, 2 tiles 2x2 K in chunks of kc. Returns the best counter
// cycles of reps passes over x.
double run_gemm(torch::Tensor x, torch::Tensor packed, int64_t mode, int64_t kc, bool hot, int64_t reps,
                torch::Tensor out) {
  static const bool perm = [] { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0; }();
  TORCH_CHECK(perm, "AMX tile data not granted");
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0), block = k * 64, n = blocks * 64;
  TORCH_CHECK(m % 32 == 0 && k % 32 == 0 && (mode != 2 || kc % 32 == 0), "rows, K and K chunks must be multiples of 32");
  const auto* a = static_cast<const uint16_t*>(x.data_ptr());
  const auto* b = static_cast<const uint16_t*>(packed.data_ptr());
  float* o = out.data_ptr<float>();
  std::vector<float> c(256 * 64);
  double best = 1e300;
  for (int64_t rep = 0; rep < reps; ++rep) {
    const uint64_t t0 = __rdtsc();
    if (mode != 0) tiles16();
    for (int64_t r0 = 0; r0 < m; r0 += 256) {
      const int64_t len = std::min<int64_t>(256, m - r0);
      for (int64_t g = 0; g < blocks; ++g) {
        const uint16_t* bb = b + (hot ? 0 : g) * block;
        const uint16_t* aa = a + r0 * k;
        if (mode == 0)
          at::native::cpublas::brgemm(len, 64, k, k, 64, 64, false, reinterpret_cast<const at::BFloat16*>(aa),
                                      reinterpret_cast<const at::BFloat16*>(bb), c.data(), true);
        else if (mode == 1)
          tiles_2x2(len, 0, k, aa, k, bb, c.data());
        else
          for (int64_t k0 = 0; k0 < k; k0 += kc) tiles_2x2(len, k0, std::min(k, k0 + kc), aa, k, bb, c.data());
        for (int64_t r = 0; r < len; ++r) std::memcpy(o + (r0 + r) * n + g * 64, c.data() + r * 64, 256);
      }
    }
    if (mode == 0) at::native::cpublas::brgemm_release(true); else _tile_release();
    best = std::min(best, double(__rdtsc() - t0));
  }
  return best;
}

torch::Tensor pack(torch::Tensor w) {  // w [N, K] bf16 -> [N/64][K/2][64][2]
  const int64_t n = w.size(0), k = w.size(1);
  const at::Tensor wt = w.t().contiguous();
  at::Tensor out = at::empty({n / 64, k / 2, 64, 2}, w.options());
  const auto* src = static_cast<const at::BFloat16*>(wt.data_ptr());
  auto* dst = static_cast<at::BFloat16*>(out.data_ptr());
  for (int64_t g = 0; g < n / 64; ++g)
    at::native::cpublas::pack(k, 64, n, 64, at::kBFloat16, at::kBFloat16, src + g * 64, dst + g * k * 64);
  return out;
}

extern "C" __m512 Sleef_expf16_u10(__m512);
static inline __m512 silu_exact(__m512 x) {
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
static inline __m256i round16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
static inline __m512 widen16(__m256i v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

// out = bf16(silu(bf16(g))) * bf16(u), rounded to bf16, as the gate/up epilogue computes it:
// mode 0 by the 65536-entry table's gather, 1 by Sleef's exp and a division. Cycles per 16.
double run_silu(torch::Tensor g, torch::Tensor u, torch::Tensor out, int64_t mode, int64_t reps) {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536 + 16);
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int b = 0; b < 65536; b += 16) {
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_set1_epi32(b), lanes), 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(t.data() + b), round16(silu_exact(x)));
    }
    return t;
  }();
  const int64_t n = g.numel();
  const float* gp = g.data_ptr<float>();
  const float* up = u.data_ptr<float>();
  auto* o = static_cast<uint16_t*>(out.data_ptr());
  double best = 1e300;
  for (int64_t rep = 0; rep < reps; ++rep) {
    const uint64_t t0 = __rdtsc();
    for (int64_t j = 0; j < n; j += 16) {
      __m512 s;
      if (mode == 0) {
        const __m512i idx = _mm512_cvtepu16_epi32(round16(_mm512_loadu_ps(gp + j)));
        s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_i32gather_epi32(idx, table.data(), 2), 16));
      } else {
        s = widen16(round16(silu_exact(widen16(round16(_mm512_loadu_ps(gp + j))))));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + j),
                          round16(_mm512_mul_ps(s, widen16(round16(_mm512_loadu_ps(up + j))))));
    }
    best = std::min(best, double(__rdtsc() - t0) / double(n / 16));
  }
  return best;
}
"""

SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def has_amx() -> bool:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "amx_bf16" in flags and "amx_tile" in flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="256,2048", help="row counts, multiples of 32")
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        rows = []
    if not rows or any(r <= 0 or r % 32 for r in rows):
        ap.error(f"--rows must be positive multiples of 32, comma-separated; got {args.rows!r}")
    if args.reps < 1:
        ap.error(f"--reps must be at least 1; got {args.reps}")
    if not has_amx():
        sys.exit("this CPU has no AMX-BF16: nothing to compare")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as build:
        ext = load_inline("pagoda_amx_probe", cpp_sources=SOURCE, functions=["run_gemm", "pack", "run_silu"],
                          extra_cflags=["-O3", "-march=native", "-mamx-tile", "-mamx-bf16"], build_directory=build)
    rate = measure_counter_rate(ext)
    print(f"one thread; time-stamp counter {rate / 1e9:.3f} GHz")
    print("| weight | case | rows | brgemm GFLOP/s | tiles 2x2 | tiles 2x2, K chunks of 288 |")
    print("|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for hot in (True, False):
        for name, (n, k) in SHAPES.items():
            w = (torch.randn(n, k) * 0.05).bfloat16()
            packed = ext.pack(w)
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                ref = torch.empty(m, n)
                base = ext.run_gemm(x, packed, 0, 0, hot, args.reps, ref)
                cells = [f"{2 * m * n * k / (base / rate) / 1e9:.0f}"]
                for mode, kc in ((1, 0), (2, 288)):
                    out = torch.empty(m, n)
                    t = ext.run_gemm(x, packed, mode, kc, hot, args.reps, out)
                    cells.append(f"{base / t:.2f}x" + ("" if torch.equal(out, ref) else " (other bits)"))
                case = "hot (one block)" if hot else "every block"
                print(f"| {name} | {case} | {m} | " + " | ".join(cells) + " |", flush=True)
    print()
    print("| gate/up epilogue, elements | table gather, cycles / 16 | Sleef exp + division | same bits |")
    print("|---|---|---|---|")
    for n in (256 * 64, 2048 * 1536):
        g, u = torch.randn(n) * 2, torch.randn(n)
        o0, o1 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
        t0, t1 = ext.run_silu(g, u, o0, 0, 20), ext.run_silu(g, u, o1, 1, 20)
        print(f"| {n} | {t0:.1f} | {t1:.1f} | {torch.equal(o0.view(torch.int16), o1.view(torch.int16))} |")


def measure_counter_rate(ext) -> float:
    """Counter cycles per second of one silu pass, timed against the wall clock."""
    n = 1 << 24
    g, u, o = torch.randn(n), torch.randn(n), torch.empty(n, dtype=torch.bfloat16)
    ext.run_silu(g, u, o, 1, 1)
    t0 = time.perf_counter()
    per16 = ext.run_silu(g, u, o, 1, 1)
    wall = time.perf_counter() - t0
    return per16 * (n / 16) / wall


if __name__ == "__main__":
    main()
