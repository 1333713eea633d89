"""The decode attention kernel against another revision of it, inside a real run of the workload.

    git show REV:kernels/csrc/paged_attention_cpu.cpp > /tmp/old.cpp
    python bench/decode_kernel_ab.py /tmp/old.cpp [--dtype bfloat16] [--workload W]

Runs the workload once with this checkout's kernels; every decode attention call of every layer
is made twice on the same inputs, once by this checkout's kernel and once by OLD.cpp's (built as
its own extension, ``bench/kernel_bench.py --cpu-baseline``), the order alternating call by call, so
both see the caches and the host as the engine leaves them (the K/V of the other layers, the GEMM
before). The engine continues with this checkout's output; the two outputs are compared bitwise.
Prints each kernel's total seconds over the run and the ratio. A kernel-level A/B in the engine's
own conditions, which ``bench/kernel_bench.py`` (synthetic caches, torch between calls) only
approximates; whole runs of bench/compare.py cannot resolve a few percent of attention.

A layer's K/V in a W decode step (~33 MB) fits the L3 share of some hosts, so the second kernel of
a pair may read it from L3: ``--first-only`` counts each kernel only where it ran first (half of
the calls each, both from DRAM as in the engine). ``--block-size`` sets the engine's KV block size;
``--max-num-seqs 1`` serves the requests one at a time (a lone sequence's decode calls).
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


def load_cpu_baseline(path: str):
    """bench/kernel_bench.py's builder, loaded under its own module name (a top-level module named
    `kernels` is what transformers probes for Hugging Face's package of that name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pagoda_bench_kernels", ROOT / "bench" / "kernel_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.load_cpu_baseline(path)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", metavar="OLD.cpp", help="another revision's kernels/csrc/paged_attention_cpu.cpp")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="W", choices=["W", "W-small"])
    ap.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    ap.add_argument("--max-num-seqs", type=int, default=None, help="the engine's max_num_seqs (default: its own)")
    ap.add_argument("--first-only", action="store_true",
                    help="time each kernel only in the calls where it runs first (cold K/V for both)")
    args = ap.parse_args()

    import torch

    from engine_service import LLM

    old_op = load_cpu_baseline(args.old).paged_decode_attention.default
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        ap.error("--max-num-seqs must be >= 1")
    opts = {} if args.max_num_seqs is None else {"max_num_seqs": args.max_num_seqs}
    engine = LLM(dtype=args.dtype, block_size=args.block_size, **opts).llm_engine
    runner = engine.runner
    runner.model.layer_stack = None  # the layers from Python, so every decode call goes through attn.decode
    if runner.attn.name != "cpu":
        ap.error(f"the engine runs the {runner.attn.name!r} attention backend, not the C++ one")
    new_decode = runner.attn.decode
    totals = {"new": 0.0, "old": 0.0}
    state = {"calls": 0, "mismatches": 0}

    def paired(q, key_cache, value_cache, meta, scale, out=None):
        bt = meta.decode_block_tables.to(torch.int32)
        sl = meta.decode_seq_lens.to(torch.int32).contiguous()
        old_out = torch.empty_like(q, memory_format=torch.contiguous_format)

        def run_old():
            old_op(q, key_cache, value_cache, bt, sl, float(scale), old_out, torch.get_num_threads())

        def run_new():
            return new_decode(q, key_cache, value_cache, meta, scale, out=out)

        order = (("new", run_new), ("old", run_old)) if state["calls"] % 2 == 0 else (("old", run_old), ("new", run_new))
        result = None
        for i, (name, fn) in enumerate(order):
            t = time.perf_counter()
            r = fn()
            if i == 0 or not args.first_only:
                totals[name] += time.perf_counter() - t
            if name == "new":
                result = r
        state["calls"] += 1
        state["mismatches"] += int(not torch.equal(result, old_out))
        return result

    requests = load_workload(args.workload)
    warm_up_pagoda(engine, requests)
    runner.attn.decode = paired

    res = drive(engine, pagoda_adder(engine), requests)
    print(f"{args.dtype} {args.workload}: {res['steps']} steps, {state['calls']} decode attention calls "
          f"(each made by both kernels), {state['mismatches']} with different outputs")
    timed = "the calls where each ran first" if args.first_only else "every call"
    print(f"decode attention ({timed}): this checkout {totals['new']:.2f} s, {args.old} {totals['old']:.2f} s: "
          f"{totals['old'] / totals['new']:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
