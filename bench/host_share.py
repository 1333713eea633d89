"""The host's share of a decode step: each ``engine.step()``'s wall time less the model's forward
and the LM head's argmax (scheduling, the step's input tensors, sampling bookkeeping, detokenizing,
the request outputs), at N greedy sequences decoding together.

    python bench/host_share.py [--seqs 1] [--tokens 1500]
                               [--against OLD_model_runner.py | --against-nta-rows 0 | --against-pad-all]

``--against``: another revision's engine_service/model_runner.py (``git show
REV:engine_service/model_runner.py > /tmp/old.py``). Its ``ModelRunner.execute`` and this
checkout's then take turns in the same engine, in blocks of 20 steps, so both see the same host
(its memory rate wanders by tens of percent from minute to minute here, far more than the host's
share of a step: whole runs in fresh processes cannot resolve it). Prints the median step and host
time of each. ``--against-nta-rows N``: the turns differ in the GEMMs' non-temporal weight reads
instead (``torch.ops.pagoda_cpu.gemm_set_nta_rows``: calls of up to N rows; this checkout's
setting in the other turns). ``--against-pad-all``: the other turns pad every GEMM input to a
multiple of ``gemm_row_multiple`` wherever that is over 1, as before ``LlamaForCausalLM.gemm_pad``
padded only the rows oneDNN multiplies (on a CPU with AMX a one-sequence decode step's 1 row went
through every layer as 8). Model loading and the first steps (prefill) are left out.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK = 20  # steps a turn


def load_runner_module(path: str):
    """``path`` as a module of its own, beside this checkout's engine_service."""
    spec = importlib.util.spec_from_file_location("engine_service.model_runner_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=1, help="sequences decoding together")
    ap.add_argument("--tokens", type=int, default=1500, help="output tokens a sequence")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    against = ap.add_mutually_exclusive_group()
    against.add_argument("--against", metavar="OLD.py", help="another revision's engine_service/model_runner.py")
    against.add_argument("--against-nta-rows", type=int, metavar="N",
                         help="the other turns with non-temporal weight reads in GEMM calls of up to N rows")
    against.add_argument("--against-pad-all", action="store_true",
                         help="the other turns with every GEMM input padded to the model's row multiple")
    args = ap.parse_args()
    if args.seqs < 1 or args.tokens < 2 * BLOCK:
        ap.error(f"--seqs must be >= 1 and --tokens >= {2 * BLOCK}")
    if args.against_nta_rows is not None and not 0 <= args.against_nta_rows <= 6:
        ap.error("--against-nta-rows must be in [0, 6]")

    from engine_service import LLM, SamplingParams
    from engine_service.model_runner import ModelRunner

    engine = LLM(dtype=args.dtype, max_num_seqs=args.seqs).llm_engine  # builds the kernels
    import torch

    set_nta = torch.ops.pagoda_cpu.gemm_set_nta_rows
    nta = set_nta(0)
    set_nta(nta)
    # name -> (ModelRunner.execute, the GEMMs' non-temporal rows, every GEMM input padded)
    impls = {"this checkout": (ModelRunner.execute, nta, False)}
    if args.against:
        impls = {args.against: (load_runner_module(args.against).ModelRunner.execute, nta, False), **impls}
    elif args.against_nta_rows is not None:
        impls = {f"nta rows {args.against_nta_rows}": (ModelRunner.execute, args.against_nta_rows, False),
                 f"this checkout (nta rows {nta})": impls["this checkout"]}
    elif args.against_pad_all:
        impls = {"every GEMM input padded": (ModelRunner.execute, nta, True), **impls}
    runner, model = engine.runner, engine.runner.model
    if args.against_pad_all and model.gemm_row_multiple == 1:
        print("this model pads no GEMM input here (gemm_row_multiple 1): nothing to compare")
        return 1

    def pad_all(rows, lm_head=False):
        return -rows % model.gemm_row_multiple

    inside = [0.0]  # seconds of this step in the forward and the LM head

    def timed(fn):
        def call(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t
        return call

    model.forward, model.greedy_tokens = timed(model.forward), timed(model.greedy_tokens)
    prompt = "Write a long story about a lighthouse keeper and the ships she guides home. " * 3
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for i in range(args.seqs):
        engine.add_request(f"r{i}", prompt, params)
    while any(s.num_output_tokens == 0 for r in engine.requests.values() for s in r.seqs):
        engine.step()  # the prefill
    steps = {name: [] for name in impls}
    host = {name: [] for name in impls}
    names = list(impls)
    k = 0
    while engine.has_unfinished_requests():
        name = names[(k // BLOCK) % len(names)]
        execute, rows, padded = impls[name]
        runner.execute = types.MethodType(execute, runner)
        set_nta(rows)
        if padded:
            model.gemm_pad = pad_all
        else:
            model.__dict__.pop("gemm_pad", None)  # the class's own
        inside[0] = 0.0
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        steps[name].append(dt)
        host[name].append(dt - inside[0])
        k += 1
    print(f"{args.dtype}, {args.seqs} sequences decoding, {k} steps")
    for name in impls:
        print(f"{name}: step median {statistics.median(steps[name]) * 1e3:.3f} ms, host median "
              f"{statistics.median(host[name]) * 1e6:.0f} us ({len(steps[name])} steps)")
    set_nta(nta)
    if len(names) == 2:
        old, new = (statistics.median(host[n]) for n in names)
        s_old, s_new = (statistics.median(steps[n]) for n in names)
        print(f"host time: {names[1]} / {names[0]} {new / old:.3f}; step time {s_new / s_old:.3f} "
              f"({names[0]} / {names[1]}: {s_old / s_new:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
