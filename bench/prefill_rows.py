"""A prefill-only step's time against its rows: does a step carry a fixed cost?

    python bench/prefill_rows.py [--prompt-len 256] [--counts 4 8 16 32] [--reps 4] [--dtype bfloat16]

Each measurement adds k random prompts of --prompt-len tokens (max_tokens=1) to an engine whose step
budget holds all of them, so the first step prefills every prompt and samples its one token, and
times that step. Counts rotate within each repetition. Prints each count's median step time and
the time per prompt token: flat per-token times mean a step's cost is its rows' work, with no
fixed cost per step (bench/RESULTS.md, forty-second session).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_runner import load_workload, warm_up_pagoda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if args.prompt_len < 1 or args.reps < 1 or min(args.counts) < 1:
        ap.error("--prompt-len, --reps and every --counts value must be >= 1")

    from engine_service import LLM, SamplingParams

    budget = max(args.counts) * args.prompt_len
    engine = LLM(dtype=args.dtype, max_num_seqs=max(256, max(args.counts)), max_num_batched_tokens=budget).llm_engine
    warm_up_pagoda(engine, load_workload("W"))
    vocab = engine.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times: dict[int, list[float]] = {k: [] for k in args.counts}
    n = 0
    for _ in range(args.reps):
        for k in args.counts:
            for _ in range(k):
                engine.add_request(f"p{n}", {"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.prompt_len)]},
                                   params)
                n += 1
            t = time.perf_counter()
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            times[k].append(time.perf_counter() - t)
            if steps != 1:
                sys.exit(f"{k} prompts took {steps} steps: the budget of {budget} tokens should hold them in one")
    for k in args.counts:
        m = statistics.median(times[k])
        rows = k * args.prompt_len
        print(f"{k:4d} prompts, {rows:6d} rows: step {m * 1e3:8.1f} ms (median of {args.reps}), "
              f"{m / rows * 1e6:6.1f} us a row; every step {[round(x * 1e3, 1) for x in times[k]]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
