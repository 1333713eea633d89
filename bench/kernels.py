"""Decode-attention micro-benchmark: the C++ paged kernel vs TorchAttention.decode (gather, then attend).

    python bench/kernels.py [--device cpu] [--reps 10] [--threads N] [--dtype bf16 fp32]

Every case runs both implementations in the same process on the same inputs: random, scattered
physical blocks; all sequences at the given context length. Several layers' worth of caches are
cycled through (more than the last-level cache holds), as in a real step where every layer reads
its own cache, so the numbers are DRAM-bound rather than cache-warm. GB/s = bytes of K and V the
attention must read (batch * context * kv_heads * head_dim * 2 * element size) / time.
"""
from __future__ import annotations

import argparse
import math
import pkgutil
import statistics
import sys
import time

import torch

# (label, q heads, kv heads, head dim, batch, context)
CASES = [
    ("smollm2", 9, 3, 64, 256, 512),
    ("smollm2", 9, 3, 64, 64, 1024),
    ("smollm2", 9, 3, 64, 8, 4096),
    ("llama8b", 32, 8, 128, 16, 1024),
    ("llama8b", 32, 8, 128, 2, 4096),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
BLOCK_SIZE = 16
MIN_CACHE_BYTES = 256 << 20  # cycle through this much KV (> L3) so every call streams from DRAM


def make_case(h, kvh, d, batch, ctx, dtype, seed=0):
    from pagoda_kernels.attention import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    nb = (ctx + BLOCK_SIZE - 1) // BLOCK_SIZE
    num_blocks = batch * nb
    kv_bytes = 2 * num_blocks * BLOCK_SIZE * kvh * d * dtype.itemsize
    layers = max(1, math.ceil(MIN_CACHE_BYTES / kv_bytes))
    caches = []
    for _ in range(layers):
        k = torch.randn(num_blocks, BLOCK_SIZE, kvh, d, generator=g).to(dtype)
        v = torch.randn(num_blocks, BLOCK_SIZE, kvh, d, generator=g).to(dtype)
        caches.append((k, v))
    block_tables = torch.randperm(num_blocks, generator=g).view(batch, nb).int()
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, h, d, generator=g).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long), num_decode_tokens=batch,
        decode_block_tables=block_tables, decode_seq_lens=seq_lens, num_prefills=0,
        prefill_query_lens=torch.zeros(0, dtype=torch.long), prefill_seq_lens=torch.zeros(0, dtype=torch.long),
        prefill_block_tables=torch.zeros(0, nb, dtype=torch.int32), max_decode_seq_len=ctx)
    bytes_read = 2 * batch * ctx * kvh * d * dtype.itemsize
    return q, caches, meta, bytes_read


def time_calls(fn, caches, reps, stat="median", warmup=2):
    """Median (or min) seconds per call, cycling through the per-layer caches."""
    n = len(caches)
    for i in range(warmup):
        fn(*caches[i % n])
    times = []
    for i in range(reps):
        k, v = caches[(i + warmup) % n]
        t = time.perf_counter()
        fn(k, v)
        times.append(time.perf_counter() - t)
    return min(times) if stat == "min" else statistics.median(times)


def bench_cpu(args):
    from pagoda_kernels.attention import TorchAttention
    from pagoda_kernels.cpu_attention import CpuAttention

    if args.threads:
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    cpu = CpuAttention()  # builds the extension on first use
    print(f"extension ready in {time.perf_counter() - t:.1f}s; torch threads: {torch.get_num_threads()}; "
          f"block size {BLOCK_SIZE}; {args.stat} of {args.reps} calls\n")
    ref = TorchAttention()
    header = (f"{'model':8} {'dtype':5} {'H/KV/D':>10} {'batch':>5} {'ctx':>5} {'KV MB':>7} | "
              f"{'torch ms':>9} {'GB/s':>6} | {'cpu ms':>8} {'GB/s':>6} | {'speedup':>7} {'max err':>8}")
    print(header)
    print("-" * len(header))
    for dname in args.dtype:
        dtype = DTYPES[dname]
        for label, h, kvh, d, batch, ctx in CASES:
            q, caches, meta, nbytes = make_case(h, kvh, d, batch, ctx, dtype)
            scale = 1 / math.sqrt(d)
            ref.prepare(meta, BLOCK_SIZE)
            k0, v0 = caches[0]
            err = (cpu.decode(q, k0, v0, meta, scale).float() - ref.decode(q, k0, v0, meta, scale).float()).abs().max()
            t_ref = time_calls(lambda k, v: ref.decode(q, k, v, meta, scale), caches, args.reps, args.stat)
            t_cpu = time_calls(lambda k, v: cpu.decode(q, k, v, meta, scale), caches, args.reps, args.stat)
            print(f"{label:8} {dname:5} {f'{h}/{kvh}/{d}':>10} {batch:5d} {ctx:5d} {nbytes / 1e6:7.1f} | "
                  f"{t_ref * 1e3:9.2f} {nbytes / t_ref / 1e9:6.1f} | {t_cpu * 1e3:8.2f} {nbytes / t_cpu / 1e9:6.1f} | "
                  f"{t_ref / t_cpu:6.1f}x {err.item():8.1e}", flush=True)
            del caches


def bench_cuda(args):
    import pagoda_kernels

    triton_mods = [m.name for m in pkgutil.iter_modules(pagoda_kernels.__path__) if "triton" in m.name]
    if not triton_mods:
        print("--device cuda: pagoda_kernels has no Triton module yet; the GPU decode-attention kernels "
              "are a separate piece of work. Nothing to benchmark.")
        return
    print(f"--device cuda: found {triton_mods}, but this benchmark does not drive them yet.")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--stat", default="median", choices=["median", "min"],
                   help="per-call time reported (min is steadier on a shared machine)")
    p.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (default: torch's)")
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    args = p.parse_args(argv)
    if args.device == "cuda":
        bench_cuda(args)
    else:
        bench_cpu(args)


if __name__ == "__main__":
    sys.exit(main())
