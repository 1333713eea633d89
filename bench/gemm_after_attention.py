"""What decode attention costs the GEMM after it (o_proj), and what does or does not take the cost.

    python bench/gemm_after_attention.py [--batch 256] [--context 448] [--layers 8] [--reps 12]

One process, SmolLM2 shapes in bf16: per layer (caches cycled over --layers, so every attention
reads from DRAM, ~88 MB at the defaults) the C++ decode attention, then oneDNN GEMMs on packed
576 x 576 weights (the o_proj shape) with the attention's output as input. Prints medians of:
o_proj straight after the attention; the same o_proj again (hot); an 8-row GEMM on a different
weight straight after the attention, and o_proj after it; an OpenMP region of ours (RMSNorm of
512 rows) after the attention, and o_proj after it. bench/RESULTS.md (thirteenth session) reads
these.
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
    args = ap.parse_args()

    import torch

    from pagoda_kernels.cpu_attention import paged_decode_attention
    from pagoda_kernels.layer_ops import CpuLayerOps

    torch.manual_seed(0)
    b, nl = args.batch, args.layers
    caches, tables, lens, q = decode_inputs(b, args.context, nl)
    w_o = [packed_weight(576, 576) for _ in range(nl)]
    w_other = packed_weight(576, 576)
    ops = CpuLayerOps()
    xs, wn = torch.randn(512, 576).bfloat16(), torch.ones(576).bfloat16()

    def attend(layer):
        kc, vc = caches[layer % nl]
        return paged_decode_attention(q, kc, vc, tables, lens, 0.125).view(b, HEADS * HEAD_DIM)

    def timed(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    names = ["attention", "o_proj after the attention", "o_proj again (hot)",
             "8-row GEMM, other weight, after the attention", "o_proj after that",
             "RMSNorm (our OpenMP region) after the attention", "o_proj after that"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(args.reps + 1):
        for layer in range(nl):
            row = []
            o = None

            def run_attention(layer=layer):
                nonlocal o
                o = attend(layer)

            row.append(timed(run_attention))
            row.append(timed(lambda: linear(o, w_o[layer])))
            row.append(timed(lambda: linear(o, w_o[layer])))
            o = attend(layer + 1)
            row.append(timed(lambda: linear(o[:8], w_other)))
            row.append(timed(lambda: linear(o, w_o[layer])))
            o = attend(layer + 2)
            row.append(timed(lambda: ops.rms_norm(xs, None, wn, 1e-5)))
            row.append(timed(lambda: linear(o, w_o[layer])))
            if rep:  # the first round warms everything up
                for n, t in zip(names, row):
                    times[n].append(t)
    print(f"bf16, {b} sequences x {args.context} tokens, {nl} layers' caches cycled; medians of "
          f"{args.reps * nl} calls")
    for n in names:
        print(f"  {n:50s} {statistics.median(times[n]) * 1e6:8.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
