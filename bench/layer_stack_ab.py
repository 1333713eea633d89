"""W with the decoder layers in one C++ call (the engine's default, ``LlamaForCausalLM.layer_stack``)
against the same layers run from Python, in fresh processes, alternating.

    python bench/layer_stack_ab.py [--pairs 5] [--dtype bfloat16]

Each run is ``bench/engine_runner.py --engine pagoda`` (all of W added at t0, greedy, detokenized),
with ``--python-layers`` for the baseline. Prints every run's output tokens/s, both means and their
ratio (bench/RESULTS.md, twenty-second session).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(dtype: str, python_layers: bool) -> float:
    return run_runner(dtype, ["--python-layers"] if python_layers else [])


def run_runner(dtype: str, options: list[str]) -> float:
    """Output tokens/s of one ``engine_runner.py --engine pagoda`` W run with ``options``."""
    cmd = [sys.executable, str(ROOT / "bench" / "engine_runner.py"), "--engine", "pagoda", "--dtype", dtype, *options]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"engine_runner failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    return res["output_tokens"] / res["elapsed"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if args.pairs < 1:
        ap.error("--pairs must be >= 1")
    runs: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.pairs):
        for python_layers in ((True, False) if i % 2 == 0 else (False, True)):
            tps = run(args.dtype, python_layers)
            runs[python_layers].append(tps)
            print(f"{'Python layers' if python_layers else 'one C++ call':>14}: {tps:.1f} output tok/s", flush=True)
    base, stack = statistics.mean(runs[True]), statistics.mean(runs[False])
    print(f"\n{args.dtype} W, {args.pairs} pairs: Python layers {base:.1f}, one C++ call {stack:.1f} output tok/s "
          f"(means); ratio {stack / base:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
