"""W through Pagoda alone and beside a neighbour that keeps one core busy part of the time, in
fresh processes, alternating; prints how much of its throughput Pagoda keeps.

    python bench/neighbour.py [--busy-ms 5] [--idle-ms 15] [--pairs 2] [--dtype bfloat16]

The neighbour is a process that spins for busy-ms, sleeps for idle-ms, and so on: busy / (busy +
idle) of one core, 25% by default, i.e. 12.5% of a 2-core machine. An engine that lost only the
cycles the neighbour takes would keep 1 - that share (87.5%); what it loses beyond is time its
threads wait for the one the OS gave to the neighbour. The engine service's event loop and gRPC
threads are such a neighbour on the engine's own cores; so are other tenants on a shared host.
Each run is ``engine_runner.py --engine pagoda --dtype DTYPE`` (all of W added at t0, greedy).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

from layer_stack_ab import run_runner  # bench/ is on the path when this runs as a script

SPIN = """
import time
busy, idle = {busy} / 1e3, {idle} / 1e3
while True:
    t = time.perf_counter()
    while time.perf_counter() - t < busy:
        pass
    time.sleep(idle)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy-ms", type=float, default=5.0)
    ap.add_argument("--idle-ms", type=float, default=15.0)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    if args.pairs < 1 or args.busy_ms <= 0 or args.idle_ms < 0:
        ap.error("--pairs must be >= 1, --busy-ms > 0 and --idle-ms >= 0")
    runs: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.pairs):
        for noisy in ((False, True) if i % 2 == 0 else (True, False)):
            neighbour = (subprocess.Popen([sys.executable, "-c", SPIN.format(busy=args.busy_ms, idle=args.idle_ms)])
                         if noisy else None)
            try:
                tps = run_runner(args.dtype, [])
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            runs[noisy].append(tps)
            print(f"{'beside the neighbour' if noisy else 'alone':>20}: {tps:.1f} output tok/s", flush=True)
    alone, noisy = statistics.mean(runs[False]), statistics.mean(runs[True])
    duty = args.busy_ms / (args.busy_ms + args.idle_ms)
    cpus = len(os.sched_getaffinity(0))
    fair = 1 - duty / cpus
    print(f"\n{args.dtype} W, {args.pairs} pairs: alone {alone:.1f}, beside a neighbour busy {duty:.0%} of one core "
          f"{noisy:.1f} output tok/s (means); kept {noisy / alone:.1%} (losing only the neighbour's cycles: "
          f"{fair:.1%} on {cpus} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
