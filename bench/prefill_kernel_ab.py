"""The CPU prefill attention kernel against another revision of it, alternating in one process.

    git show REV:kernels/csrc/paged_attention_cpu.cpp > /tmp/old.cpp
    python bench/prefill_kernel_ab.py /tmp/old.cpp [--dtype bfloat16] [--calls 40]

Builds OLD.cpp as its own extension (``bench/kernel_bench.py --cpu-baseline``) beside this checkout's
kernels and times both ``paged_prefill_attention`` ops on the same inputs, call by call in
alternating order, for W-like steps at SmolLM2's shapes (9 q heads, 3 kv heads, head_dim 64; K/V
blocks at random places): several prompts of 256 tokens, one 2048-token chunk, chunks after 256
cached tokens, many short prompts, and a 512-token chunk after 1536 cached. Prints each kernel's
milliseconds a call, GFLOP/s on the causal FLOPs (4 x head_dim per query-key pair and head), the
speed ratio (> 1: this checkout faster) and whether the two outputs are bitwise equal.
bench/RESULTS.md (twenty-third session) reads it.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_bench import BLOCK_SIZE, _cpu_prefill_inputs, load_cpu_baseline  # noqa: E402
from pagoda_kernels.cpu_attention import CpuAttention, load_extension  # noqa: E402

H, KV, D = 9, 3, 64
CASES = {  # name: (cached tokens, new tokens) per sequence
    "8 x 256": [(0, 256)] * 8,
    "1 x 2048": [(0, 2048)],
    "4 x (256 + 256)": [(256, 256)] * 4,
    "20 x 100": [(0, 100)] * 20,
    "1536 + 512": [(1536, 512)],
}


def make_case(chunks, dtype):
    """The op's inputs for one step (bench/kernel_bench.py's prefill inputs, int32 tables as CpuAttention
    prepares them) and the step's causal FLOPs."""
    q, _, _, key_cache, value_cache, meta = _cpu_prefill_inputs(H, KV, D, chunks, dtype)
    CpuAttention().prepare(meta, BLOCK_SIZE)
    c = meta.cache
    inputs = (q, key_cache, value_cache, c["prefill_block_tables"], c["prefill_query_start"], c["prefill_seq_lens"])
    return inputs, sum(4 * H * D * (n * ctx + n * (n + 1) // 2) for ctx, n in chunks)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", metavar="OLD.cpp", help="another revision's kernels/csrc/paged_attention_cpu.cpp")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--calls", type=int, default=40, help="timed calls of each kernel per case")
    args = ap.parse_args()
    if args.calls < 1:
        ap.error("--calls must be >= 1")
    load_extension()
    new_op = torch.ops.pagoda_cpu.paged_prefill_attention
    old_op = load_cpu_baseline(args.old).paged_prefill_attention
    dtype = getattr(torch, args.dtype)
    threads = torch.get_num_threads()
    print(f"{args.dtype}, {threads} threads, {args.calls} calls each, alternating; old = {args.old}\n")
    print("| chunks | old ms | new ms | old GFLOP/s | new GFLOP/s | new / old speed | bitwise |")
    print("|---|---|---|---|---|---|---|")
    for name, chunks in CASES.items():
        inputs, flops = make_case(chunks, dtype)
        outs = [torch.empty_like(inputs[0]), torch.empty_like(inputs[0])]
        ops = [new_op, old_op]
        for k in (0, 1, 0, 1):
            ops[k](*inputs, 0.125, outs[k], threads)
        same = torch.equal(outs[0], outs[1])
        spent = [0.0, 0.0]
        for i in range(args.calls):
            for k in ((0, 1) if i % 2 == 0 else (1, 0)):
                t0 = time.perf_counter()
                ops[k](*inputs, 0.125, outs[k], threads)
                spent[k] += time.perf_counter() - t0
        new_ms, old_ms = (s / args.calls * 1e3 for s in spent)
        print(f"| {name} | {old_ms:.3f} | {new_ms:.3f} | {flops / old_ms / 1e6:.0f} | {flops / new_ms / 1e6:.0f} "
              f"| {old_ms / new_ms:.3f} | {same} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
