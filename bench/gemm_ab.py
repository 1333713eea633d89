"""W with Pagoda's bf16 GEMMs on and off (``cpu_bf16_gemm``), alternating in one process, with the GEMMs
and the ops they fuse timed by row count.

    python bench/gemm_ab.py [--order 0,1,1,0] [--dtype bfloat16]

Each run builds a fresh engine (so no prefix cache carries over), adds all of W at t0 as
bench/engine_runner.py does, and steps to completion; --order gives the runs (1: on). Prints
each run's output tokens/s, then per configuration the seconds summed over its runs of: oneDNN
linear calls by weight rows N (o_proj / down 576, QKV 960, gate/up 3072, LM head 49152), the
gemm_* ops, silu_and_mul, rotary_qkv_to_cache, RMSNorm and decode attention, each by the call's
row count (<= 256: decode steps, <= 1024, > 1024: prefill steps). bench/RESULTS.md (fifteenth
session: AMX; nineteenth: Zen 4) reads these. Needs a CPU with AVX512-BF16 or AMX-BF16 for the
"on" runs to differ. (Named amx_ab.py before the nineteenth session.)
"""
from __future__ import annotations

import argparse
import collections
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_runner import drive, load_workload, pagoda_adder, warm_up_pagoda  # noqa: E402

OPS = ("silu_and_mul", "rotary_qkv_to_cache", "rms_norm", "gemm_linear", "gemm_linear_silu_mul",
       "gemm_linear_rotary_qkv_to_cache", "gemm_linear_argmax")


def bucket(rows: int) -> str:
    return "<=256" if rows <= 256 else ("<=1024" if rows <= 1024 else ">1024")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--order", default="0,1,1,0")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()

    import engine_service.models.llama as llama
    from engine_service import LLM

    requests = load_workload("W")
    seconds: dict[tuple, float] = collections.defaultdict(float)
    calls: dict[tuple, int] = collections.defaultdict(int)
    runs: dict[bool, list[float]] = collections.defaultdict(list)
    linear = llama.linear

    def timed(fn, on, label):
        def wrapper(x, *a, **k):
            t = time.perf_counter()
            try:
                return fn(x, *a, **k)
            finally:
                key = (on, label, bucket(x.shape[0]))
                seconds[key] += time.perf_counter() - t
                calls[key] += 1
        return wrapper

    for on in (x.strip() == "1" for x in args.order.split(",")):
        llm = LLM(dtype=args.dtype, max_num_seqs=256, cpu_bf16_gemm=on)
        engine = llm.llm_engine
        ops, attn = engine.runner.layer_ops, engine.runner.attn
        engine.runner.model.layer_stack = None  # the layers from Python, so the timers see their calls
        for name in OPS:
            if hasattr(ops, name):
                setattr(ops, name, timed(getattr(ops, name), on, name))
        attn.decode = timed(attn.decode, on, "decode attention")

        def timed_linear(x, weight, bias=None, packed=False, on=on):
            return timed(linear, on, f"oneDNN linear N={weight.shape[0]}")(x, weight, bias, packed)

        llama.linear = timed_linear
        warm_up_pagoda(engine, requests)
        res = drive(engine, pagoda_adder(engine), requests)
        runs[on].append(res["output_tokens"] / res["elapsed"])
        print(f"cpu_bf16_gemm={on}: {runs[on][-1]:.1f} output tok/s ({res['elapsed']:.2f} s)", flush=True)
        llama.linear = linear
        del llm, engine, ops, attn
        gc.collect()
    for on, rates in runs.items():
        print(f"cpu_bf16_gemm={on}: mean {sum(rates) / len(rates):.1f} output tok/s over {len(rates)} runs")
    print("| part | rows | off s | on s | calls (off / on) |\n|---|---|---|---|---|")
    for label, rows in sorted({k[1:] for k in seconds}):
        off, on = seconds.get((False, label, rows), 0.0), seconds.get((True, label, rows), 0.0)
        print(f"| {label} | {rows} | {off:.2f} | {on:.2f} | {calls.get((False, label, rows), 0)} / "
              f"{calls.get((True, label, rows), 0)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
