"""How many multiply-adds a second one core's dot-product instructions give, by instruction set.

    python bench/isa_rates.py [--all-cores]

Compiles a small C++ probe with g++ -O3 -march=native and times, on one thread, long runs of
independent accumulations (24 vector accumulators, 4 AMX tiles) for every instruction this CPU
has: fp32 FMA (ymm, zmm), AVX512-BF16 `vdpbf16ps`, AVX512-VNNI / AVX-VNNI `vpdpbusd` (u8 x s8 into
int32) and `vpdpwssd` (s16 x s16 into int32), and AMX `tdpbf16ps` / `tdpbusd`. Prints each one's
instructions and multiply-adds a second. What it answers: whether a lower-precision form of a GEMM
or of the attention kernels' products has more arithmetic to give on this kind. (On the 2-core Zen
4, `vpdpbusd` and `vpdpwssd` zmm issue at ~0.6x `vdpbf16ps`'s rate, so int8 gives about as many
multiply-adds as bf16 there and int16 about 0.6x as many: bench/RESULTS.md, forty-fifth and
seventy-second sessions.)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <sys/syscall.h>
#include <unistd.h>

using clk = std::chrono::steady_clock;
static void report(const char* name, long instrs, double macs_each, clk::time_point t0) {
  const double s = std::chrono::duration<double>(clk::now() - t0).count();
  std::printf("| %s | %.2f | %.1f |\n", name, instrs / s / 1e9, instrs * macs_each / s / 1e9);
}
#define REPEAT24(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
                    X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
constexpr long kIters = 20000000;  // x 24 instructions

#define VEC_PROBE(NAME, MACS, T, INIT, OP, FOLD)                                   \
  {                                                                                \
    T acc[24];                                                                     \
    for (int i = 0; i < 24; ++i) acc[i] = INIT;                                    \
    T a = INIT, b = INIT;                                                          \
    const auto t0 = clk::now();                                                    \
    for (long it = 0; it < kIters; ++it) {                                         \
      _Pragma("GCC unroll 24") for (int i = 0; i < 24; ++i) acc[i] = OP;           \
      asm volatile("" : "+v"(a));                                                  \
    }                                                                              \
    report(NAME, kIters * 24, MACS, t0);                                           \
    T s = acc[0];                                                                  \
    for (int i = 1; i < 24; ++i) s = FOLD;                                         \
    asm volatile("" : : "v"(s));                                                   \
  }

int main() {
  std::printf("| instruction (one core) | G instructions/s | G multiply-adds/s |\n|---|---|---|\n");
#if defined(__AVX2__) && defined(__FMA__)
  VEC_PROBE("vfmadd231ps ymm (fp32)", 8, __m256, _mm256_set1_ps(1.f), _mm256_fmadd_ps(a, a, acc[i]),
            _mm256_add_ps(s, acc[i]))
#endif
#if defined(__AVX512F__)
  VEC_PROBE("vfmadd231ps zmm (fp32)", 16, __m512, _mm512_set1_ps(1.f), _mm512_fmadd_ps(a, a, acc[i]),
            _mm512_add_ps(s, acc[i]))
#endif
#if defined(__AVX512BF16__)
  VEC_PROBE("vdpbf16ps zmm (bf16)", 32, __m512, _mm512_set1_ps(1.f),
            _mm512_dpbf16_ps(acc[i], (__m512bh)a, (__m512bh)a), _mm512_add_ps(s, acc[i]))
#endif
#if defined(__AVX512BF16__)
  {  // the GEMM's micro-kernel as cpu_ops.cpp's dp_rows<6> runs it, on an L1-resident A and B
    constexpr int kPairs = 32;
    alignas(64) static uint32_t a[6][kPairs] = {};
    alignas(64) static uint16_t b[kPairs][128] = {};
    __m512 acc[6][4];
    for (auto& r : acc)
      for (auto& v : r) v = _mm512_setzero_ps();
    const long iters = kIters / kPairs;
    const auto t0 = clk::now();
    for (long it = 0; it < iters; ++it) {
      for (int p = 0; p < kPairs; ++p) {
        const __m512bh b0 = (__m512bh)_mm512_load_si512(b[p]), b1 = (__m512bh)_mm512_load_si512(b[p] + 32),
                       b2 = (__m512bh)_mm512_load_si512(b[p] + 64), b3 = (__m512bh)_mm512_load_si512(b[p] + 96);
        for (int r = 0; r < 6; ++r) {
          const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r][p]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], av, b0);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], av, b1);
          acc[r][2] = _mm512_dpbf16_ps(acc[r][2], av, b2);
          acc[r][3] = _mm512_dpbf16_ps(acc[r][3], av, b3);
        }
      }
      asm volatile("" : : "r"(&a[0][0]), "r"(&b[0][0]) : "memory");
    }
    report("vdpbf16ps zmm, the GEMM's 6 x 64 loop from L1", iters * kPairs * 24, 32, t0);
    __m512 s = _mm512_setzero_ps();
    for (auto& r : acc)
      for (auto& v : r) s = _mm512_add_ps(s, v);
    asm volatile("" : : "v"(s));
  }
#endif
#if defined(__AVX512VNNI__)
  VEC_PROBE("vpdpbusd zmm (int8)", 64, __m512i, _mm512_set1_epi32(0x01010101), _mm512_dpbusd_epi32(acc[i], a, a),
            _mm512_add_epi32(s, acc[i]))
#endif
#if defined(__AVX512VNNI__)
  VEC_PROBE("vpdpwssd zmm (int16)", 32, __m512i, _mm512_set1_epi32(0x00010001), _mm512_dpwssd_epi32(acc[i], a, a),
            _mm512_add_epi32(s, acc[i]))
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  VEC_PROBE("vpdpbusd ymm (int8)", 32, __m256i, _mm256_set1_epi32(0x01010101), _mm256_dpbusd_epi32(acc[i], a, a),
            _mm256_add_epi32(s, acc[i]))
#elif defined(__AVXVNNI__)
  VEC_PROBE("vpdpbusd ymm (int8, AVX-VNNI)", 32, __m256i, _mm256_set1_epi32(0x01010101),
            _mm256_dpbusd_avx_epi32(acc[i], a, a), _mm256_add_epi32(s, acc[i]))
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__)
  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0) {
    alignas(64) unsigned char cfg[64] = {1};  // palette 1: 8 tiles of 16 rows x 64 bytes
    for (int t = 0; t < 8; ++t) {
      cfg[16 + 2 * t] = 64;
      cfg[48 + t] = 16;
    }
    _tile_loadconfig(cfg);
    alignas(64) static unsigned char buf[16 * 64] = {};
    _tile_loadd(4, buf, 64); _tile_loadd(5, buf, 64); _tile_loadd(6, buf, 64); _tile_loadd(7, buf, 64);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const long iters = kIters / 8;
    auto t0 = clk::now();
    for (long it = 0; it < iters; ++it) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    report("tdpbf16ps (AMX bf16, 16x16x32)", iters * 4, 16 * 16 * 32, t0);
    t0 = clk::now();
    for (long it = 0; it < iters; ++it) {
      _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7); _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
    }
    report("tdpbusd (AMX int8, 16x16x64)", iters * 4, 16 * 16 * 64, t0);
    _tile_release();
  } else {
    std::printf("| AMX | (the kernel refused the tile state) | |\n");
  }
#endif
  return 0;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--all-cores", action="store_true",
                    help="also run the probe on every core at once, one process pinned to each, and print each "
                         "core's table (what a core gets while the others work, as in the engine's GEMMs)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "probe.cpp", Path(d) / "probe"
        src.write_text(PROBE)
        subprocess.run(["g++", "-O3", "-march=native", "-o", str(exe), str(src)], check=True)
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")
        if args.all_cores:
            cores = sorted(os.sched_getaffinity(0))
            procs = [subprocess.Popen([str(exe)], stdout=subprocess.PIPE, text=True,
                                      preexec_fn=lambda c=c: os.sched_setaffinity(0, {c})) for c in cores]
            for c, proc in zip(cores, procs):
                out, _ = proc.communicate()
                if proc.returncode:
                    raise SystemExit(f"the probe on core {c} exited with {proc.returncode}")
                print(f"\nCore {c}, with all {len(cores)} cores running the probe at once:")
                print(out.replace("(one core)", f"(core {c})"), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
