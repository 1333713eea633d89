"""Per-step wall times of one engine on the shared workload: where a run's time goes by phase.

    <venv>/bin/python bench/step_trace.py --engine pagoda|vllm [--model-dir DIR] [--json out.json]

Runs bench/engine_runner.py's engine set-up (same options, same warm-up), adds every request at t0
and times each ``step()``. Prints the prefill phase (steps until every request has its first token)
and the decode phase that follows, with their median step times, and optionally every step as
JSON rows [t_end_s, step_s, first_tokens, outputs]. Comparing the phases of two engines shows which
kind of step a throughput or TTFT difference comes from (bench/RESULTS.md, AMX host section).
For vLLM run it with the vLLM venv's python and VLLM_CPU_KVCACHE_SPACE=4 VLLM_CPU_OMP_THREADS_BIND=0-1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_runner  # noqa: E402


def trace(engine, add, requests) -> dict:
    t0 = time.perf_counter()
    for r in requests:
        add(r)
    rows, seen = [], set()
    while engine.has_unfinished_requests():
        s = time.perf_counter()
        outs = engine.step()
        e = time.perf_counter()
        first = 0
        for o in outs:
            c = o.outputs[0] if o.outputs else None
            if c is not None and len(c.token_ids) and o.request_id not in seen:
                seen.add(o.request_id)
                first += 1
        rows.append((round(e - t0, 4), round(e - s, 5), first, len(outs)))
    return {"rows": rows, "elapsed": time.perf_counter() - t0, "requests": len(requests)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, choices=["pagoda", "vllm"])
    engine_runner.add_engine_arguments(ap)
    ap.add_argument("--json", default=None, help="write every step's row here")
    args = ap.parse_args()
    args.detokenize = True
    requests = engine_runner.load_workload(args.workload)
    captured = {}

    def drive(engine, add, reqs):
        captured.update(trace(engine, add, reqs))
        return {"elapsed": captured["elapsed"]}

    engine_runner.drive = drive
    {"pagoda": engine_runner.run_pagoda, "vllm": engine_runner.run_vllm}[args.engine](args, requests)
    rows = captured["rows"]
    seen, split = 0, len(rows)
    for i, (_, _, first, _) in enumerate(rows):
        seen += first
        if seen >= captured["requests"]:
            split = i + 1
            break
    pre, dec = rows[:split], rows[split:]
    for name, part in (("prefill phase", pre), ("decode phase", dec)):
        if part:
            print(f"{name}: {len(part)} steps, {sum(r[1] for r in part):.2f} s, "
                  f"median step {statistics.median(r[1] for r in part) * 1e3:.1f} ms")
    print(f"total: {len(rows)} steps, {captured['elapsed']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
