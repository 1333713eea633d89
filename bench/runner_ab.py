"""W through Pagoda with two sets of ``bench/engine_runner.py`` options, in fresh processes,
alternating (ABBA...), for engine settings that have an option there.

    python bench/runner_ab.py --a "--matmul-dtype float32" --b "" [--pairs 2] [--dtype bfloat16]

Each run is ``engine_runner.py --engine pagoda --dtype DTYPE`` plus the set's options (all of W added
at t0, greedy, detokenized). Prints every run's output tokens/s, both means and B / A.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

from layer_stack_ab import run_runner  # bench/ is on the path when this runs as a script


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="", help="engine_runner options of the baseline")
    ap.add_argument("--b", default="", help="engine_runner options of the candidate")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    sets = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    runs: dict[str, list[float]] = {"A": [], "B": []}
    for i in range(args.pairs):
        for name in (("A", "B") if i % 2 == 0 else ("B", "A")):
            tps = run_runner(args.dtype, sets[name])
            runs[name].append(tps)
            print(f"{name} ({args.a if name == 'A' else args.b or 'defaults'}): {tps:.1f} output tok/s", flush=True)
    a, b = statistics.mean(runs["A"]), statistics.mean(runs["B"])
    print(f"\n{args.dtype} W, {args.pairs} pairs: A {a:.1f}, B {b:.1f} output tok/s (means); B / A {b / a:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
