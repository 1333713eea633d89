"""The last layer on sampled rows only, against the full last layer, on the same steps.

    python bench/last_layer_ab.py [--dtype bfloat16] [--workload W]

Runs the workload as bench/engine_runner.py does (every request added at t0, greedy), and executes
each step that has prefill rows twice on the same input — ``ModelRunner.prune_last_layer`` on and
off, the order alternating from step to step — keeping the second result (a step's K/V writes
are idempotent and greedy sampling has no state, so both executions compute the same thing).
Prints the summed seconds of each variant over those steps and their ratio: a paired
measurement, so host noise between runs does not enter it. Decode-only steps are the same
either way (every row is sampled) and run once.
"""
from __future__ import annotations

import argparse
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
    args = ap.parse_args()

    from engine_service import LLM

    requests = load_workload(args.workload)
    engine = LLM(dtype=args.dtype, max_num_seqs=256).llm_engine
    runner = engine.runner
    warm_up_pagoda(engine, requests)
    execute = runner.execute
    seconds = {True: 0.0, False: 0.0}
    steps = [0, 0]  # with prefill rows, decode-only

    def paired(out, forks, structured_output=None):
        if not out.seqs or all(n == 1 for n in out.num_new_tokens):
            steps[1] += 1
            return execute(out, forks, structured_output)
        steps[0] += 1
        res = None
        for prune in ((True, False) if steps[0] % 2 else (False, True)):
            runner.prune_last_layer = prune
            t = time.perf_counter()
            res = execute(out, forks, structured_output)
            seconds[prune] += time.perf_counter() - t
        return res

    runner.execute = paired

    drive(engine, pagoda_adder(engine), requests)
    print(f"{args.dtype} {args.workload}: {steps[0]} steps with prefill rows (each run both ways), "
          f"{steps[1]} decode-only steps")
    print(f"full last layer {seconds[False]:.2f} s, sampled rows only {seconds[True]:.2f} s: "
          f"{seconds[False] / seconds[True]:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
