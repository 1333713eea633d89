"""What decode attention costs the GEMM after it (o_proj), and what does or does not take the cost.

    python bench/gemm_after_attention.py [--batch 256] [--context 448] [--layers 8] [--reps 12]
        [--gemm onednn|pagoda] [--spin-us 0]

One process, SmolLM2 shapes in bf16: per layer (caches cycled over --layers, so every attention
reads from DRAM, ~88 MB at the defaults) the C++ decode attention, then GEMMs on 576 x 576
weights (the o_proj shape) with the attention's output as input: oneDNN's packed linear, or with
``--gemm pagoda`` Pagoda's own bf16 GEMM (what the engine runs a decode step's o_proj on where the
CPU has AVX512-BF16 or AMX). Prints medians of: o_proj straight after the attention; the same
o_proj again (hot); an 8-row GEMM on a different weight straight after the attention, and o_proj
after it; an OpenMP region of ours (RMSNorm of 512 rows) after the attention, and o_proj after it;
a one-thread op (a 9 KB clone) after the attention, and o_proj after it; o_proj after a busy-wait
of ``--spin-us`` in Python following the attention. Then the same clone after other work: the
attention, a 128 MB read, a 64 MB write, 20 hot o_proj GEMMs, a 4 ms sleep, or the clone itself.
bench/RESULTS.md (thirteenth, forty-third and forty-fourth sessions) reads these. Python runs between the timed ops, unlike in the engine's one C++ call for
the decoder layers, so the costs read here bound the engine's from above.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_fixture import HEAD_DIM, HEADS, decode_inputs, linear, packed_weight  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--gemm", default="onednn", choices=["onednn", "pagoda"],
                    help="whose GEMM runs the o_proj-shaped calls")
    ap.add_argument("--spin-us", type=float, default=0.0,
                    help="busy-wait this long after the attention before the last o_proj")
    args = ap.parse_args()
    if min(args.batch, args.context, args.layers, args.reps) < 1 or args.spin_us < 0:
        ap.error("--batch, --context, --layers and --reps must be >= 1, --spin-us >= 0")

    import torch

    from pagoda_kernels.cpu_attention import paged_decode_attention
    from pagoda_kernels.layer_ops import CpuLayerOps

    from engine_service import cpu_malloc

    cpu_malloc.tune_for_engine()  # the engine's malloc settings: no mmap / munmap per activation
    torch.manual_seed(0)
    b, nl = args.batch, args.layers
    caches, tables, lens, q = decode_inputs(b, args.context, nl)
    ops = CpuLayerOps()
    if args.gemm == "pagoda":
        if not ops.bf16_gemm:
            sys.exit("--gemm pagoda: this CPU has neither AVX512-BF16 nor AMX-BF16")

        def weight(n, k):
            return ops.gemm_pack((torch.randn(n, k) * 0.05).bfloat16())

        gemm = ops.gemm_linear
    else:
        weight, gemm = packed_weight, linear
    w_o = [weight(576, 576) for _ in range(nl)]
    w_other = weight(576, 576)
    x_small = torch.randn(8, 576).bfloat16()
    xs, wn = torch.randn(512, 576).bfloat16(), torch.ones(576).bfloat16()

    def attend(layer):
        kc, vc = caches[layer % nl]
        return paged_decode_attention(q, kc, vc, tables, lens, 0.125).view(b, HEADS * HEAD_DIM)

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def spin(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    names = ["attention", "o_proj after the attention", "o_proj again (hot)",
             "8-row GEMM, other weight, after the attention", "o_proj after the 8-row GEMM",
             "RMSNorm (our OpenMP region) after the attention", "o_proj after the RMSNorm",
             "9 KB clone (one thread) after the attention", "o_proj after the clone",
             f"o_proj after a {args.spin_us:g} us busy-wait after the attention"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps + 1):
        for layer in range(nl):
            row = []
            o = None

            def run_attention(layer=layer):
                nonlocal o
                o = attend(layer)

            row.append(timed(run_attention))
            row.append(timed(lambda: gemm(o, w_o[layer])))
            row.append(timed(lambda: gemm(o, w_o[layer])))
            o = attend(layer + 1)
            row.append(timed(lambda: gemm(o[:8], w_other)))
            row.append(timed(lambda: gemm(o, w_o[layer])))
            o = attend(layer + 2)
            row.append(timed(lambda: ops.rms_norm(xs, None, wn, 1e-5)))
            row.append(timed(lambda: gemm(o, w_o[layer])))
            o = attend(layer + 3)
            row.append(timed(lambda: x_small.clone()))
            row.append(timed(lambda: gemm(o, w_o[layer])))
            o = attend(layer + 4)
            spin(args.spin_us * 1e-6)
            row.append(timed(lambda: gemm(o, w_o[layer])))
            if rep:  # the first round warms everything up
                for n, t in zip(names, row):
                    times[n].append(t)
    print(f"bf16, {b} sequences x {args.context} tokens, {nl} layers' caches cycled; medians of "
          f"{args.reps * nl} calls")
    for n in names:
        print(f"  {n:50s} {statistics.median(times[n]) * 1e6:8.1f} us")

    # The same one-thread clone after other kinds of work: is its cost the attention's instruction
    # mix, or that any large sweep of memory leaves the caller's code and data cold?
    big = torch.ones(64 << 20, dtype=torch.bfloat16)  # 128 MB
    x_gemm = torch.randn(256, 576).bfloat16()
    before = {
        "decode attention": lambda i: attend(i),
        "a 128 MB read (torch sum)": lambda i: big.sum(),
        "a 64 MB write (torch fill_)": lambda i: big[: 32 << 20].fill_(1.0),
        "20 hot o_proj GEMMs, 256 rows": lambda i: [gemm(x_gemm, w_other) for _ in range(20)],
        "a 4 ms sleep": lambda i: time.sleep(0.004),
        "the same clone (hot)": lambda i: x_small.clone(),
    }
    after: dict[str, list[float]] = {n: [] for n in before}
    for rep in range(args.reps * nl // 4 + 1):
        for n, work in before.items():
            work(rep)
            t = timed(lambda: x_small.clone())
            if rep:
                after[n].append(t)
    print(f"9 KB clone (one thread) after ...; medians of {args.reps * nl // 4} calls")
    for n in before:
        print(f"  {n:50s} {statistics.median(after[n]) * 1e6:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
