"""The decoder layers' one C++ call against another revision's, inside a real run of the workload.

    git worktree add /tmp/old REV
    python bench/layers_call_ab.py /tmp/old/kernels/csrc [--dtype bfloat16] [--workload W]

Builds OLD_CSRC's sources (every ``.cpp`` there, its library renamed ``pagoda_cpu_baseline``) as an
extension of its own beside this checkout's, runs the workload with this checkout's engine, and
makes every ``decoder_layers`` call twice on copies of the same inputs: once by this checkout's
op and once by OLD_CSRC's, the order alternating call by call, so both see the host and the caches
as the engine leaves them. The K/V both write is the same (the outputs are compared bitwise, and
the caches too, through the next calls' outputs). Prints each op's total seconds over the run, by
kind of step (decode rows only, or with prefill rows), and the ratio. For changes inside the layer
stack (the GEMMs' epilogues, RMSNorm, the attention kernels) a paired measurement resolves what
whole runs of bench/compare.py on a noisy host cannot. Both ops take the same arguments, so the
old revision's ``decoder_layers`` must have this checkout's signature and inputs.

Calibrate with the same sources on both sides first (``cp -r kernels/csrc /tmp/same``): that A/A
gave 0.993-0.995x over W on the AMX host (bench/RESULTS.md, thirty-fourth session).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from decode_kernel_ab import load_cpu_baseline  # noqa: E402
from engine_runner import drive, load_workload, pagoda_adder, warm_up_pagoda  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", metavar="OLD_CSRC", help="another revision's kernels/csrc directory")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="W", choices=["W", "W-small"])
    args = ap.parse_args()

    import torch

    from engine_service import LLM

    old_op = load_cpu_baseline(args.old).decoder_layers.default
    engine = LLM(dtype=args.dtype).llm_engine
    ops = engine.runner.layer_ops
    if not getattr(ops, "runs_decoder_layers", False) or engine.runner.model.layer_stack is None:
        ap.error("this engine does not run its decoder layers in one C++ call")
    new_op = ops._decoder_layers
    totals = {(name, kind): 0.0 for name in ("new", "old") for kind in ("decode", "prefill")}
    state = {"calls": 0, "mismatches": 0, "decode": 0, "prefill": 0}

    def paired(h, residual, *rest):
        slot_mapping, num_decode = rest[5], rest[6]
        kind = "decode" if num_decode == slot_mapping.shape[0] else "prefill"
        inputs = {"new": (h.clone(), None if residual is None else residual.clone()),
                  "old": (h.clone(), None if residual is None else residual.clone())}
        outs = {}
        # The order alternates within each kind of step (decode and prefill steps may alternate).
        order = ("new", "old") if state[kind] % 2 == 0 else ("old", "new")
        state[kind] += 1
        for name in order:
            h_in, res_in = inputs[name]
            a = [h_in, res_in, *rest]
            op = old_op if name == "old" else new_op
            t = time.perf_counter()
            outs[name] = op(*a)
            totals[(name, kind)] += time.perf_counter() - t
        state["calls"] += 1
        same = all(torch.equal(x, y) for x, y in zip(outs["new"], outs["old"]))
        state["mismatches"] += int(not same)
        return outs["new"]

    requests = load_workload(args.workload)
    warm_up_pagoda(engine, requests)
    ops._decoder_layers = paired
    res = drive(engine, pagoda_adder(engine), requests)
    print(f"{args.dtype} {args.workload}: {res['steps']} steps, {state['calls']} decoder_layers calls (each made "
          f"by both ops), {state['mismatches']} with different outputs")
    print("| steps | this checkout s | old s | old / this |")
    print("|---|---|---|---|")
    for kind in ("decode", "prefill", "all"):
        kinds = ("decode", "prefill") if kind == "all" else (kind,)
        new = sum(totals[("new", k)] for k in kinds)
        old = sum(totals[("old", k)] for k in kinds)
        label = {"decode": "decode rows only", "prefill": "with prefill rows", "all": "all"}[kind]
        print(f"| {label} | {new:.2f} | {old:.2f} | {old / new:.3f}x |" if new else f"| {label} | 0 | 0 | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
