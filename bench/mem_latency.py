"""One core's memory latency and how many misses it keeps in flight: pointer chases over random spans.

    python bench/mem_latency.py [--mb 1024] [--sizes 2,8,32,64,256,1024] [--no-huge]

A buffer (on 2 MiB pages, as the engine's KV cache and weights, unless ``--no-huge``) is cut into
spans at random places and linked into chains; each step of a chain reads the pointer in its
span's first line and one word of every other line of the span (independent loads). One chain of
single lines is the load-to-use latency; k chains side by side show how many misses the core
overlaps (the curve flattens where its line fill buffers run out) and the rate that allows.
Spans of 384 B (one token's K, or V, for SmolLM2's three kv heads) up to 192 KiB (12 KiB: the
32-token span of K, or of V, that decode attention reads at a time from a 64-token block) show
what the hardware prefetchers add to a scattered read such as decode attention's.
Then one chain of single lines over buffers of ``--sizes`` MiB, after a warm-up pass, to find
where reads leave this VM's share of the L3. One thread; a C++ helper built at first use
(``torch.utils.cpp_extension.load_inline``). bench/RESULTS.md (forty-fourth session) reads it.
"""
from __future__ import annotations

import argparse
import sys

from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <sys/mman.h>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

// Seconds for `visits` span visits spread over `chains` chains (each chain visits[/chains] spans),
// in a fresh `mb` MiB buffer of `span`-byte spans linked at random.
double chase(int64_t mb, bool huge, int64_t span, int64_t chains, int64_t visits, bool warm) {
  TORCH_CHECK(span >= 64 && span % 64 == 0, "span must be a positive multiple of 64 bytes");
  TORCH_CHECK(chains >= 1 && chains <= 64, "chains must be 1..64");
  const size_t bytes = static_cast<size_t>(mb) << 20, spans = bytes / span;
  TORCH_CHECK(spans >= static_cast<size_t>(2 * chains), "buffer too small for the chains");
  char* buf = static_cast<char*>(mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  TORCH_CHECK(buf != MAP_FAILED, "mmap failed");
  madvise(buf, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  std::memset(buf, 1, bytes);
  std::vector<uint32_t> order(spans);
  std::iota(order.begin(), order.end(), 0u);
  std::shuffle(order.begin(), order.end(), std::mt19937_64(1234));
  for (size_t i = 0; i < spans; ++i)
    *reinterpret_cast<char**>(buf + order[i] * span) = buf + order[(i + 1) % spans] * span;
  const int64_t lines = span / 64;
  char* p[64];
  for (int64_t c = 0; c < chains; ++c) p[c] = buf + order[(spans / chains) * c] * span;
  const int64_t steps = visits / chains;
  uint64_t sink = 0;
  auto walk = [&](int64_t n) {
    for (int64_t s = 0; s < n; ++s)
      for (int64_t c = 0; c < chains; ++c) {
        char* q = p[c];
        for (int64_t l = 1; l < lines; ++l) sink += *reinterpret_cast<volatile uint64_t*>(q + l * 64);
        p[c] = *reinterpret_cast<char* volatile*>(q);
      }
  };
  if (warm) walk(static_cast<int64_t>(spans / chains));  // one pass: what stays cached is warm
  const auto t0 = std::chrono::steady_clock::now();
  walk(steps);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  munmap(buf, bytes);
  return sink == 42 ? -dt : dt;  // keep the loads
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=1024, help="buffer for the chain sweeps (MiB; beyond the L3)")
    ap.add_argument("--sizes", default="2,8,32,64,256,1024", help="buffers for the latency sweep (MiB)")
    ap.add_argument("--no-huge", action="store_true", help="4 KiB pages instead of 2 MiB ones")
    args = ap.parse_args()
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error("--sizes takes comma-separated integers (MiB)")
    if args.mb < 16 or min(sizes) < 1:
        ap.error("--mb must be >= 16 and every --sizes entry >= 1")
    mod = load_inline(name="pagoda_mem_chase", cpp_sources=SOURCE, functions=["chase"], extra_cflags=["-O2"])
    huge = not args.no_huge
    print(f"one thread, {args.mb} MiB buffer on {'2 MiB' if huge else '4 KiB'} pages")
    print("| span | chains | ns per visit per chain | GB/s |")
    print("|---|---|---|---|")
    for span, chain_counts in ((64, (1, 2, 4, 8, 12, 16, 20, 24, 32, 48)), (384, (1, 2, 4, 8, 16)),
                               (3072, (1, 2)), (12288, (1, 2)), (24576, (1, 2)), (49152, (1, 2)),
                               (196608, (1, 2))):
        visits = max(2_000_000 * 64 // span, 20_000)
        for k in chain_counts:
            dt = abs(mod.chase(args.mb, huge, span, k, visits, False))
            print(f"| {span} B | {k} | {dt / (visits // k) * 1e9:.1f} | {visits // k * k * span / dt / 1e9:.2f} |")
    print()
    print("| buffer MiB | one chain of single lines, ns per load (after a warm-up pass) |")
    print("|---|---|")
    for mb in sizes:
        visits = 2_000_000
        dt = abs(mod.chase(mb, huge, 64, 1, visits, True))
        print(f"| {mb} | {dt / visits * 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
