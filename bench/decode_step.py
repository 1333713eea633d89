"""One decode-only step of Pagoda, taken apart: each GEMM shape's rate inside the engine.

    python bench/decode_step.py [--requests 256] [--steps 30] [--dtype bfloat16] [--again]

Adds the first --requests prompts of W (each with room for 400 new tokens), steps until every one
of them has its first token, then times --steps decode-only steps (batch = --requests rows). Prints
the step's median and mean time, decode attention's and the KV write's share, and for every GEMM
shape (N x K of the weight; Pagoda's own bf16 GEMMs and their fused forms included, keyed by the
weight they multiply) its milliseconds per step and GFLOP/s. With --again each GEMM runs a
second time straight after the first, on the same input and weight (its result discarded, its time
listed apart; the step times then include the repeats): the gap between the two is what the state
left by the preceding op costs the GEMM (bench/RESULTS.md, tenth session). bench/parts.py gives
the same split over a whole W run.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_runner import load_workload, start_decoding, warm_up_pagoda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256, help="decode batch size (first N requests of W)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--again", action="store_true", help="time every GEMM a second time, straight after the first")
    args = ap.parse_args()
    if not 1 <= args.requests <= 256:
        ap.error("--requests must be in 1..256 (W has 256 requests)")
    if args.steps < 1:
        ap.error("--steps must be >= 1")

    import engine_service.models.llama as llama
    from engine_service import LLM
    from pagoda_kernels.layer_ops import GEMM_BLOCK_N

    requests = load_workload("W")[:args.requests]
    engine = LLM(dtype=args.dtype, max_num_seqs=256).llm_engine
    engine.runner.model.layer_stack = None  # the layers from Python, so the timers below see their calls
    warm_up_pagoda(engine, requests)
    seconds: dict[str, float] = collections.defaultdict(float)       # decode, write_kv
    gemm: dict[tuple[int, int], float] = collections.defaultdict(float)  # (N, K) -> s
    again: dict[tuple[int, int], float] = collections.defaultdict(float)
    rows: dict[tuple[int, int], int] = collections.defaultdict(int)

    def timed_gemm(call, x, key_of):
        """``call()`` on input ``x``, timed under ``key_of(output)`` (the weight's N x K); with --again
        run a second time."""
        t = time.perf_counter()
        y = call()
        key = key_of(y)
        gemm[key] += time.perf_counter() - t
        rows[key] += x.shape[0]
        if args.again:
            t = time.perf_counter()
            call()
            again[key] += time.perf_counter() - t
        return y

    linear = llama.linear
    llama.linear = lambda x, weight, bias=None, packed=False: timed_gemm(
        lambda: linear(x, weight, bias, packed), x, lambda y: (y.shape[-1], x.shape[-1]))
    # Pagoda's own GEMMs (bf16 on CPUs with AVX512-BF16 or AMX, float32 on CPUs with AVX2 and FMA),
    # plain and fused, keyed by their weight's N x K as the oneDNN ones are: the packed weight is
    # [N / 64, ...] in either layout.
    ops = engine.runner.layer_ops
    for name in ("gemm_linear", "gemm_linear_silu_mul", "gemm_linear_rotary_qkv_to_cache", "gemm_linear_argmax"):
        if hasattr(ops, name):
            setattr(ops, name, lambda x, packed, *a, _fn=getattr(ops, name), **k: timed_gemm(
                lambda: _fn(x, packed, *a, **k), x, lambda y: (packed.shape[0] * GEMM_BLOCK_N, x.shape[-1])))
    attn = engine.runner.attn
    for name in ("decode", "write_kv"):
        fn = getattr(attn, name)

        def timed(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                seconds[_name] += time.perf_counter() - t

        setattr(attn, name, timed)

    prefill_steps = start_decoding(engine, requests)
    for d in (seconds, gemm, again, rows):
        d.clear()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)

    n = args.steps
    ms = lambda s: 1e3 * s / n  # noqa: E731
    print(f"{args.dtype}, {args.requests} sequences decoding (after {prefill_steps} steps to start them all): "
          f"step median {1e3 * statistics.median(times):.1f} ms, mean {1e3 * sum(times) / n:.1f} ms")
    print("| part | ms per step | GFLOP/s |" + (" again: ms per step |" if args.again else "")
          + "\n|---|---|---|" + ("---|" if args.again else ""))
    for key in ("decode", "write_kv"):
        print(f"| attention.{key} | {ms(seconds[key]):.2f} | |" + (" |" if args.again else ""))
    print(f"| all GEMMs | {ms(sum(gemm.values())):.2f} | |" + (" |" if args.again else ""))
    for (out_f, in_f), s in sorted(gemm.items(), key=lambda x: -x[1]):
        rate = 2 * out_f * in_f * rows[(out_f, in_f)] / s / 1e9
        repeat = f" {ms(again[(out_f, in_f)]):.2f} |" if args.again else ""
        print(f"| GEMM {out_f} x {in_f} | {ms(s):.2f} | {rate:.0f} |{repeat}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
