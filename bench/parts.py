"""Where a run's time goes: each part of Pagoda's forward timed inside a real run of the workload.

    python bench/parts.py --dtype bfloat16 [--workload W]

Wraps the callables of one engine's step with wall-clock timers (the linear layers, the LM head,
decode / prefill attention, the KV write, the fused layer ops, the model forward, the runner's
step and the scheduler), adds every request of the workload at t0 as bench/engine_runner.py does,
and steps to completion. Prints the run's output tokens/s and each part's seconds, share of the
run and call count. The timers cost a few microseconds per call (~1% of a W run), so compare
parts within one run, and speeds between runs with bench/compare.py. The same split is what
bench/RESULTS.md reports per host.

The decoder layers run from Python here (``LlamaForCausalLM.layer_stack`` off: the same kernels,
but the engine's one C++ call for all layers would hide them from the timers), so the run is a few
% slower than the engine's (bench/layer_stack_ab.py); ``--layer-stack`` keeps the C++ call (then
only the forward, LM head, last pruned layer, runner and scheduler are split).
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_runner import drive, load_workload, pagoda_adder, warm_up_pagoda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="W", choices=["W", "W-small"])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--num-speculative-tokens", type=int, default=0, help="prompt-lookup drafts per step (0: off)")
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--layer-stack", action="store_true",
                    help="keep the decoder layers in one C++ call (their parts are then not timed)")
    args = ap.parse_args()

    import engine_service.models.llama as llama
    from engine_service import LLM

    requests = load_workload(args.workload)
    engine = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, block_size=args.block_size,
                 num_speculative_tokens=args.num_speculative_tokens).llm_engine
    runner = engine.runner
    if not args.layer_stack:
        runner.model.layer_stack = None
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)

    def timed(fn, label):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[label] += time.perf_counter() - t
                calls[label] += 1
        return wrapper

    # The model calls the module-level linear (every projection and the LM head).
    llama.linear = timed(llama.linear, "linear (layers + LM head)")
    for name in ("decode", "prefill", "write_kv"):
        setattr(runner.attn, name, timed(getattr(runner.attn, name), f"attention.{name}"))
    for name in ("rms_norm", "rotary", "rotary_qkv_to_cache", "silu_and_mul", "gemm_linear", "gemm_linear_silu_mul",
                 "gemm_linear_argmax", "gemm_linear_rotary_qkv_to_cache"):
        if hasattr(runner.layer_ops, name):
            setattr(runner.layer_ops, name, timed(getattr(runner.layer_ops, name), f"layer_ops.{name}"))
    runner.model.compute_logits = timed(runner.model.compute_logits, "LM head (compute_logits)")
    # an all-greedy step's LM head with its argmax, where it runs on Pagoda's GEMM
    runner.model.greedy_tokens = timed(runner.model.greedy_tokens, "LM head (greedy_tokens)")
    runner.model.forward = timed(runner.model.forward, "model forward")
    runner.execute = timed(runner.execute, "runner.execute")
    engine.scheduler.schedule = timed(engine.scheduler.schedule, "scheduler.schedule")

    warm_up_pagoda(engine, requests)
    seconds.clear()
    calls.clear()

    res = drive(engine, pagoda_adder(engine), requests)
    elapsed, steps = res["elapsed"], res["steps"]
    out_tokens = sum(r["max_tokens"] for r in requests)
    print(f"{args.dtype} {args.workload}: {elapsed:.1f} s, {out_tokens / elapsed:.1f} output tok/s, {steps} steps")
    print("| part | s | share of run | calls |\n|---|---|---|---|")
    for label, s in sorted(seconds.items(), key=lambda x: -x[1]):
        print(f"| {label} | {s:.2f} | {100 * s / elapsed:.1f}% | {calls[label]} |")
    print("(model forward contains linear, attention and layer_ops; runner.execute contains the forward, "
          "the LM head and sampling; the LM head's GEMM is also in linear, or in layer_ops.gemm_linear where it runs on "
          "Pagoda's GEMM, and an all-greedy step's LM head is greedy_tokens = layer_ops.gemm_linear_argmax; with AVX512-BF16 or AMX the layers' "
          "GEMMs are layer_ops.gemm_* (with AMX up to 1024 rows), the fused ones including silu * up / rotary "
          "+ KV write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
