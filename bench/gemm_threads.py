"""Pagoda's float32 GEMM against this host's FMA peak, on one thread and on two.

    python bench/gemm_threads.py [--rows 8 64 256 2048] [--shapes qkv o gate_up down] [--layers 20] [--rounds 5]

The peak is a loop of 12 independent FMA chains on the widest vectors the compiler targets here
(-march=native: 16 lanes with AVX-512, 8 with AVX2), built at first use; it measures what the
cores can do with no memory traffic at all, and it moves with the host. The GEMM is the engine's
(``CpuLayerOps.gemm_linear``'s C++ op, into a preallocated output) on the bundled model's weight
shapes, weights cycled over ``--layers`` copies (cold, as in a step through 30 layers). Thread
counts alternate round by round in one process; each figure is the best round. Prints GFLOP/s and
the share of the same thread count's peak, so a GEMM that loses its rate on two threads shows as a
lower share there. bench/RESULTS.md (thirty-fifth session, Zen 3) reads it. Needs a CPU with AVX2
and FMA (the GEMM is built only there).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# fp32_linear_ab imports engine_service, which puts torch's buffers on huge pages as in the engine
# (before any allocation); its SHAPES are the bundled model's weight shapes.
from fp32_linear_ab import SHAPES as ALL_SHAPES, gemm_parser  # noqa: E402

SHAPES = {name: ALL_SHAPES[name] for name in ("qkv", "o", "gate_up", "down")}  # the decoder layers' GEMMs

FMA_SOURCE = r"""
#include <torch/extension.h>
#include <omp.h>
#include <chrono>
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(kLanes * 4)));

// GFLOP/s of `threads` threads each running `iters` rounds of 12 independent FMAs.
double fma_peak(int64_t threads, int64_t iters) {
  const auto t0 = std::chrono::steady_clock::now();
  float sink = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    vf acc[12];
    vf b, c;
    for (int l = 0; l < kLanes; ++l) {
      b[l] = 1.0000001f;
      c[l] = 1e-7f;
    }
    for (int j = 0; j < 12; ++j)
      for (int l = 0; l < kLanes; ++l) acc[j][l] = static_cast<float>(j + omp_get_thread_num());
    for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
      for (int j = 0; j < 12; ++j) acc[j] = acc[j] * b + c;
    }
    for (int j = 0; j < 12; ++j) sink += acc[j][0];
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink == 0.5f ? -1.0 : threads * iters * 12.0 * kLanes * 2.0 / s / 1e9;  // sink keeps the loop
}
"""


def main() -> None:
    ap = gemm_parser(__doc__, [8, 64, 256, 2048], SHAPES)
    ap.add_argument("--layers", type=int, default=20, help="weight copies cycled per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from pagoda_kernels.layer_ops import CpuLayerOps

    ops = CpuLayerOps()
    if not ops.f32_gemm:
        sys.exit("Pagoda's float32 GEMM is not built on this CPU (it needs AVX2 and FMA)")
    peak_mod = load_inline(name="pagoda_fma_peak", cpp_sources=FMA_SOURCE, functions=["fma_peak"],
                           extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=fast"],
                           extra_ldflags=["-fopenmp"])
    threads = (1, 2)
    peak = {t: max(peak_mod.fma_peak(t, 50_000_000) for _ in range(3)) for t in threads}
    print("FMA peak: " + ", ".join(f"{t} thread{'s' if t > 1 else ''} {peak[t]:.1f} GFLOP/s" for t in threads))
    print("| rows | weight | 1 thread GFLOP/s | % of peak | 2 threads GFLOP/s | % of peak | 2 / 1 |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for rows in args.rows:
        for name in args.shapes:
            n, k = SHAPES[name]
            weights = [ops.gemm_pack(torch.randn(n, k)) for _ in range(args.layers)]
            x, out = torch.randn(rows, k), torch.empty(rows, n)
            flops = 2.0 * rows * n * k * len(weights)
            reps = max(1, int(2e9 / flops))
            best = {t: float("inf") for t in threads}
            for r in range(args.rounds):
                for t in threads if r % 2 == 0 else threads[::-1]:
                    torch.set_num_threads(t)
                    ops._gemm_linear(x, weights[-1], out)
                    start = time.perf_counter()
                    for _ in range(reps):
                        for w in weights:
                            ops._gemm_linear(x, w, out)
                    best[t] = min(best[t], (time.perf_counter() - start) / reps)
            rate = {t: flops / best[t] / 1e9 for t in threads}
            print(f"| {rows} | {name} {n}x{k} | {rate[1]:.1f} | {100 * rate[1] / peak[1]:.0f}% | {rate[2]:.1f} | "
                  f"{100 * rate[2] / peak[2]:.0f}% | {rate[2] / rate[1]:.2f} |", flush=True)


if __name__ == "__main__":
    main()
