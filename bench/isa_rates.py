"""How many multiply-adds a second one core's dot-product instructions give, by instruction set.

    python bench/isa_rates.py

Compiles a small C++ probe with g++ -O3 -march=native and times, on one thread, long runs of
independent accumulations (24 vector accumulators, 4 AMX tiles) for every instruction this CPU
has: fp32 FMA (ymm, zmm), AVX512-BF16 `vdpbf16ps`, AVX512-VNNI / AVX-VNNI `vpdpbusd` (u8 x s8 into
int32), and AMX `tdpbf16ps` / `tdpbusd`. Prints each one's instructions and multiply-adds a second.
What it answers: whether a lower-precision form of a GEMM has more arithmetic to give on this
kind. (On the 2-core Zen 4, `vpdpbusd` zmm issues at half `vdpbf16ps`'s rate, so int8 gives no
more multiply-adds than bf16 there: bench/RESULTS.md, forty-fifth session.)
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = r"""
#include <immintrin.h>
#include <chrono>
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
#if defined(__AVX512VNNI__)
  VEC_PROBE("vpdpbusd zmm (int8)", 64, __m512i, _mm512_set1_epi32(0x01010101), _mm512_dpbusd_epi32(acc[i], a, a),
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
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "probe.cpp", Path(d) / "probe"
        src.write_text(PROBE)
        subprocess.run(["g++", "-O3", "-march=native", "-o", str(exe), str(src)], check=True)
        print(subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
