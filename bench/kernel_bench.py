"""Attention kernel micro-benchmarks.

    python bench/kernel_bench.py [--device cpu] [--reps 10] [--threads N] [--dtype bf16 fp32] [--only prefill|layer_ops]
                            [--cpu-baseline OLD.cpp]
    python bench/kernel_bench.py --device cuda [--dtype bf16] [--peak-gbs 3350 --peak-tflops 989]

CPU decode: the C++ paged decode kernel vs TorchAttention.decode (gather, then attend). Every case
runs the implementations in the same process on the same inputs, calls interleaved: random,
scattered physical blocks; all sequences at the given context length. Several layers' worth of
caches are cycled through (more than the last-level cache holds), as in a real step where every
layer reads its own cache, so the numbers are DRAM-bound rather than cache-warm. GB/s = bytes of K
and V the attention must read (batch * context * kv_heads * head_dim * 2 * element size) / time.
``--cpu-baseline OLD.cpp`` also builds an older paged_attention_cpu.cpp (e.g. ``git show
REV:kernels/csrc/paged_attention_cpu.cpp > /tmp/old.cpp``) as a separate extension and times its
decode kernel in the same loop: before / after in one process.

CPU prefill: the C++ prefill kernel (one call for all of a step's chunks) vs TorchAttention.prefill
(one SDPA call per sequence; a chunk with cached context gathers it through the block table and
uses an additive mask), on the same caches with the chunks' K/V written in as the layer does.
GFLOP/s counts the causal work only (4 * H * D per visible query-key pair).

CPU layer ops: the fused C++ ops (CpuLayerOps: residual + RMSNorm, silu * up, greedy argmax) vs the
torch reference ops (TorchLayerOps) at a 2048-token prefill step's and a 256-sequence decode step's
shapes of SmolLM2, calls interleaved on the same inputs.

CUDA: the Triton kernels (kernels/triton_attention.py), timed with triton.testing.do_bench (which
flushes L2 between calls): paged decode vs TorchAttention.decode, prefill vs dense causal SDPA on
the same tokens (no paging: the yardstick), reshape_and_cache vs write_kv (index_copy_). Each row
gives the floor the kernel could reach at the stated peaks (bytes / peak bandwidth for decode and
the cache write, FLOPs / peak tensor throughput for prefill) and the share of it reached.
"""
from __future__ import annotations

import argparse
import copy
import importlib
import math
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
# The same shapes small enough that their bf16 K/V (0.8-1 MB) stay within a core's L2: the kernels'
# arithmetic alone (bench/kv_fp8_decode.py and bench/kernel_knockout.py, ``--hot``).
HOT_CASES = [("smollm2", 9, 3, 64, 4, 512), ("llama8b", 32, 8, 128, 1, 256)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
BLOCK_SIZE = 64  # KV block size (tokens): the engine's default, 64 on CPU and 16 on CUDA (set in main)
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


def time_interleaved(fns, caches, reps, stat="median", warmup=2):
    """Seconds per call of each fn(k, v), the fns called in turn each repetition (so a noisy
    neighbour hits them alike), cycling through the per-layer caches. Each call reads the next layer
    (every call finds its layer last read the same number of calls ago), and the order of the fns
    rotates every repetition (each follows each of the others equally often). Indexing the layer by
    repetition + fn index in a fixed order instead had each fn read the layer the fn after it had read
    one repetition before, and every C++ call follow the same neighbour (torch's gather, which
    leaves a large write-back behind): on a Sapphire-Rapids-class host with a 480 MB L3 that moved a
    fn's time by up to ~25% by its position alone."""
    n, m = len(caches), len(fns)
    c = 0
    for i in range(warmup):
        for fn in fns:
            fn(*caches[c % n])
            c += 1
    times = [[] for _ in fns]
    for i in range(reps):
        for r in range(m):
            j = (i + r) % m
            k, v = caches[c % n]
            c += 1
            t = time.perf_counter()
            fns[j](k, v)
            times[j].append(time.perf_counter() - t)
    return [min(x) if stat == "min" else statistics.median(x) for x in times]


def load_cpu_baseline(path):
    """Build an older paged_attention_cpu.cpp, or a whole kernels/csrc directory (every .cpp in it),
    as its own extension: ops under torch.ops.pagoda_cpu_baseline."""
    from pathlib import Path

    from pagoda_kernels.cpu_attention import _CSRC

    path = Path(path)
    files = sorted(path.glob("*.cpp")) if path.is_dir() else [path]
    texts = {("baseline.cpp" if len(files) == 1 else f.name): f.read_text() for f in files}
    return load_cpu_sources(texts, "pagoda_cpu_baseline", headers=path if path.is_dir() else _CSRC)


def load_cpu_sources(texts, namespace, headers=None):
    """Build C++ sources ({file name: text}) whose ops are registered under pagoda_cpu as their own
    extension, with the kernels' flags: ops under torch.ops.<namespace>. ``headers``: the folder
    with pagoda_cpu.h (default kernels/csrc)."""
    import hashlib

    from torch.utils.cpp_extension import load

    from pagoda_kernels.cpu_attention import _CFLAGS, _CSRC, _LDFLAGS, _cache_root, _ensure_ninja_on_path

    renamed = {}
    for name, text in texts.items():
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_FRAGMENT"):
            text = text.replace(f"{macro}(pagoda_cpu,", f"{macro}({namespace},")
        renamed[name] = text
    assert any(f"TORCH_LIBRARY({namespace}," in t for t in renamed.values()), \
        f"{sorted(texts)}: no TORCH_LIBRARY(pagoda_cpu, ...) block"
    tag = hashlib.sha1(("".join(renamed.values()) + " ".join(_CFLAGS) + sys.prefix).encode()).hexdigest()[:12]
    build_dir = _cache_root() / "torch_extensions" / f"{namespace}-{tag}"
    build_dir.mkdir(parents=True, exist_ok=True)
    for name, text in renamed.items():
        (build_dir / name).write_text(text)
    _ensure_ninja_on_path()
    load(name=f"{namespace}_{tag}", sources=[str(build_dir / n) for n in renamed], extra_cflags=_CFLAGS,
         extra_ldflags=_LDFLAGS, extra_include_paths=[str(headers or _CSRC)], build_directory=str(build_dir),
         is_python_module=False)
    return getattr(torch.ops, namespace)


def bench_cpu(args):
    from pagoda_kernels.attention import TorchAttention
    from pagoda_kernels.cpu_attention import CpuAttention

    if args.threads:
        torch.set_num_threads(args.threads)
    t = time.perf_counter()
    cpu = CpuAttention()  # builds the extension on first use
    baseline = load_cpu_baseline(args.cpu_baseline) if args.cpu_baseline else None
    print(f"extensions ready in {time.perf_counter() - t:.1f}s; torch threads: {torch.get_num_threads()}; "
          f"block size {BLOCK_SIZE}; {args.stat} of {args.reps} calls, interleaved"
          + (f"; before = {args.cpu_baseline}" if baseline else "") + "\n")
    if args.only in (None, "decode"):
        bench_cpu_decode(args, cpu, baseline)
    if args.only in (None, "prefill"):
        bench_cpu_prefill(args, cpu)
    if args.only in (None, "layer_ops"):
        bench_cpu_layer_ops(args)


def bench_cpu_layer_ops(args):
    from pagoda_kernels.layer_ops import CpuLayerOps, TorchLayerOps

    cpu, ref = CpuLayerOps(), TorchLayerOps()
    print("== layer ops (C++ vs torch reference, same inputs)")
    header = f"{'op':10} {'dtype':5} {'shape':>12} | {'torch ms':>9} | {'C++ ms':>8} | {'speedup':>7}"
    print(header)
    print("-" * len(header))
    g = torch.Generator().manual_seed(0)
    for dname in args.dtype:
        dtype = DTYPES[dname]
        if dtype not in (torch.float32, torch.bfloat16):
            continue
        for rows in (2048, 256):
            x = torch.randn(rows, 576, generator=g).to(dtype)
            res = torch.randn(rows, 576, generator=g).to(dtype)
            w = torch.randn(576, generator=g).to(dtype)
            gate_up = torch.randn(rows, 3072, generator=g).to(dtype)
            cases = [("rms_norm", (rows, 576), lambda o: o.rms_norm(x, res.clone(), w, 1e-5)),
                     ("silu_mul", (rows, 1536), lambda o: o.silu_and_mul(gate_up))]
            if rows == 256:
                logits = torch.randn(rows, 49152, generator=g).to(dtype)
                cases.append(("argmax", (rows, 49152), lambda o: o.argmax(logits)))
            for name, shape, fn in cases:
                t_ref, t_cpu = time_interleaved([lambda k_, v_: fn(ref), lambda k_, v_: fn(cpu)], [(None, None)],
                                                args.reps, args.stat)
                print(f"{name:10} {dname:5} {f'{shape[0]}x{shape[1]}':>12} | {t_ref * 1e3:9.3f} | {t_cpu * 1e3:8.3f} | "
                      f"{t_ref / t_cpu:6.2f}x", flush=True)
    print()


def bench_cpu_decode(args, cpu, baseline):
    from pagoda_kernels.attention import TorchAttention

    ref = TorchAttention()
    print("== paged decode")
    header = (f"{'model':8} {'dtype':5} {'H/KV/D':>10} {'batch':>5} {'ctx':>5} {'KV MB':>7} | "
              f"{'torch ms':>9} {'GB/s':>6} | " + (f"{'before ms':>9} {'GB/s':>6} | " if baseline else "")
              + f"{'cpu ms':>8} {'GB/s':>6} | {'vs torch':>8} " + (f"{'vs before':>9} " if baseline else "")
              + f"{'max err':>8}")
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
            fns = [lambda k, v: ref.decode(q, k, v, meta, scale), lambda k, v: cpu.decode(q, k, v, meta, scale)]
            if baseline:
                out = torch.empty_like(q)
                bt, sl, nt = meta.decode_block_tables, meta.decode_seq_lens, torch.get_num_threads()
                fns.append(lambda k, v: baseline.paged_decode_attention(q, k, v, bt, sl, scale, out, nt))
            times = time_interleaved(fns, caches, args.reps, args.stat)
            t_ref, t_cpu = times[0], times[1]
            before = ""
            if baseline:
                t_old = times[2]
                before = f"{t_old * 1e3:9.2f} {nbytes / t_old / 1e9:6.1f} | "
            print(f"{label:8} {dname:5} {f'{h}/{kvh}/{d}':>10} {batch:5d} {ctx:5d} {nbytes / 1e6:7.1f} | "
                  f"{t_ref * 1e3:9.2f} {nbytes / t_ref / 1e9:6.1f} | {before}{t_cpu * 1e3:8.2f} "
                  f"{nbytes / t_cpu / 1e9:6.1f} | {t_ref / t_cpu:7.1f}x "
                  + (f"{times[2] / t_cpu:8.2f}x " if baseline else "") + f"{err.item():8.1e}", flush=True)
            del caches
    print()


# (label, q heads, kv heads, head dim, [(cached context, query chunk) per sequence])
CPU_PREFILL_CASES = [
    ("smollm2", 9, 3, 64, [(0, 512)] * 4),
    ("smollm2", 9, 3, 64, [(0, 2048)]),
    ("smollm2", 9, 3, 64, [(1536, 512)]),
    ("smollm2", 9, 3, 64, [(256, 256)] * 8),
    ("smollm2", 9, 3, 64, [(0, 96), (0, 480), (0, 300), (0, 200), (0, 410), (0, 150), (0, 412)]),  # a W step
]


def _cpu_prefill_inputs(h, kvh, d, chunks, dtype, seed=0):
    """One prefill step as the engine runs it: scattered blocks, each chunk's K/V written into the cache
    (the context's is random), metadata as the model runner builds it."""
    from pagoda_kernels.attention import AttentionMetadata, write_kv

    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor([c + n for c, n in chunks])
    qlens = torch.tensor([n for _, n in chunks])
    nbs = [-(-int(n) // BLOCK_SIZE) for n in seq_lens]
    perm = torch.randperm(sum(nbs), generator=g)
    bt = torch.zeros(len(chunks), max(nbs), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = perm[at:at + nb].int()
        at += nb
    kc = torch.randn(sum(nbs), BLOCK_SIZE, kvh, d, generator=g).to(dtype)
    vc = torch.randn(sum(nbs), BLOCK_SIZE, kvh, d, generator=g).to(dtype)
    t = int(qlens.sum())
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(t, kvh, d, generator=g).to(dtype)
    v = torch.randn(t, kvh, d, generator=g).to(dtype)
    seq_idx = torch.repeat_interleave(torch.arange(len(chunks)), qlens)
    cu = torch.zeros(len(chunks) + 1, dtype=torch.long)
    cu[1:] = qlens.cumsum(0)
    pos = (seq_lens - qlens)[seq_idx] + torch.arange(t) - cu[seq_idx]
    slots = bt[seq_idx, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    write_kv(k, v, kc, vc, slots)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decode_tokens=0, decode_block_tables=torch.zeros(0, max(nbs), dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32), num_prefills=len(chunks), prefill_query_lens=qlens,
        prefill_seq_lens=seq_lens, prefill_block_tables=bt, max_prefill_query_len=int(qlens.max()),
        max_prefill_seq_len=int(seq_lens.max()))
    return q, k, v, kc, vc, meta


def _without_amx(fn):
    torch.ops.pagoda_cpu.set_prefill_amx(False)
    try:
        return fn()
    finally:
        torch.ops.pagoda_cpu.set_prefill_amx(True)


def bench_cpu_prefill(args, cpu):
    from pagoda_kernels.attention import TorchAttention
    from pagoda_kernels.cpu_attention import prefill_supported

    ref = TorchAttention()
    # bf16 on AMX tiles where the CPU has them; the vector panels are timed beside them.
    amx = torch.bfloat16 in [DTYPES[d] for d in args.dtype] and prefill_supported(torch.bfloat16) \
        and bool(torch.ops.pagoda_cpu.set_prefill_amx(True))
    print("== prefill / chunked prefill (chunks = cached context + query tokens per sequence)"
          + (" [bf16: AMX; the vector panels timed beside it]" if amx else ""))
    header = (f"{'model':8} {'dtype':5} {'H/KV/D':>10} {'chunks':>14} {'GFLOP':>6} | {'torch ms':>9} {'GFLOP/s':>7} | "
              f"{'cpu ms':>8} {'GFLOP/s':>7} | {'speedup':>7} {'max err':>8}")
    print(header)
    print("-" * len(header))
    for dname in args.dtype:
        dtype = DTYPES[dname]
        if not prefill_supported(dtype):
            print(f"({dname}: no C++ prefill kernel on this CPU; CpuAttention uses the torch path)")
            continue
        for label, h, kvh, d, chunks in CPU_PREFILL_CASES:
            q, k, v, kc, vc, meta = _cpu_prefill_inputs(h, kvh, d, chunks, dtype)
            scale = 1 / math.sqrt(d)
            ref.prepare(meta, BLOCK_SIZE)
            cmeta = copy.copy(meta)
            cpu.prepare(cmeta, BLOCK_SIZE)
            err = (cpu.prefill(q, k, v, kc, vc, cmeta, scale).float()
                   - ref.prefill(q, k, v, kc, vc, meta, scale).float()).abs().max().item()
            flops = sum(4 * h * d * (n * c + n * (n + 1) // 2) for c, n in chunks)
            fns = [lambda k_, v_: ref.prefill(q, k, v, kc, vc, meta, scale),
                   lambda k_, v_: cpu.prefill(q, k, v, kc, vc, cmeta, scale)]
            if amx and dtype == torch.bfloat16:
                fns.append(lambda k_, v_: _without_amx(lambda: cpu.prefill(q, k, v, kc, vc, cmeta, scale)))
            t_ref, t_cpu, *t_vec = time_interleaved(fns, [(kc, vc)], args.reps, args.stat)
            desc = f"{chunks[0][0]}+{chunks[0][1]}" + (f" x{len(chunks)}" if len(chunks) > 1 else "")
            vec = f" | vectors {t_vec[0] * 1e3:.2f} ms: AMX {t_vec[0] / t_cpu:.2f}x" if t_vec else ""
            print(f"{label:8} {dname:5} {f'{h}/{kvh}/{d}':>10} {desc:>14} {flops / 1e9:6.2f} | {t_ref * 1e3:9.2f} "
                  f"{flops / t_ref / 1e9:7.1f} | {t_cpu * 1e3:8.2f} {flops / t_cpu / 1e9:7.1f} | "
                  f"{t_ref / t_cpu:6.2f}x {err:8.1e}{vec}", flush=True)
    print()


# (label, q heads, kv heads, head dim, batch, context)
CUDA_DECODE_CASES = [
    ("llama8b", 32, 8, 128, 64, 2048),
    ("llama8b", 32, 8, 128, 256, 1024),
    ("llama8b", 32, 8, 128, 8, 8192),
    ("llama8b", 32, 8, 128, 1, 32768),
    ("smollm2", 9, 3, 64, 256, 512),
]
# (label, q heads, kv heads, head dim, [(cached context, query chunk) per sequence])
CUDA_PREFILL_CASES = [
    ("llama8b", 32, 8, 128, [(0, 4096)]),
    ("llama8b", 32, 8, 128, [(0, 1024)] * 4),
    ("llama8b", 32, 8, 128, [(3072, 1024)]),
    ("llama8b", 32, 8, 128, [(0, 512)] * 8),
    # Short chunks after a long context (prefix-cache hits, the tail of a chunked prompt): fewer
    # query tokens than a tile holds, where packing a GQA group's heads into the tile matters.
    ("llama8b", 32, 8, 128, [(2048, 64)] * 16),
    ("llama8b", 32, 8, 128, [(2048, 16)] * 16),
    ("smollm2", 9, 3, 64, [(0, 4096)]),  # group 3
]
CUDA_WRITE_TOKENS = [64, 4096]


def _decode_inputs(h, kvh, d, batch, ctx, dtype, device, block_size=None, seed=0):
    """Device tensors for one decode case: scattered blocks, every sequence at ``ctx``."""
    from pagoda_kernels.attention import AttentionMetadata

    block_size = block_size or BLOCK_SIZE
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // block_size)
    num_blocks = batch * nb
    kc = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype).to(device)
    vc = torch.randn(num_blocks, block_size, kvh, d, generator=g).to(dtype).to(device)
    bt = torch.randperm(num_blocks, generator=g).view(batch, nb).int()
    sl = torch.full((batch,), ctx, dtype=torch.int32)
    q = torch.randn(batch, h, d, generator=g).to(dtype).to(device)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long), num_decode_tokens=batch, decode_block_tables=bt,
        decode_seq_lens=sl, num_prefills=0, prefill_query_lens=torch.zeros(0, dtype=torch.long),
        prefill_seq_lens=torch.zeros(0, dtype=torch.long), prefill_block_tables=torch.zeros(0, nb, dtype=torch.int32),
        max_decode_seq_len=ctx)
    return q, kc, vc, meta


def _torch_decode_on(device, meta, block_size):
    """TorchAttention.decode with its metadata and mask moved to ``device`` (its prepare() builds them
    on the host)."""
    from pagoda_kernels.attention import TorchAttention

    ref = TorchAttention()
    dmeta = copy.copy(meta)
    ref.prepare(dmeta, block_size)  # on the host, as the engine does
    dmeta.decode_block_tables = meta.decode_block_tables.to(device)
    dmeta.decode_seq_lens = meta.decode_seq_lens.to(device)
    dmeta.cache["decode_mask"] = dmeta.cache["decode_mask"].to(device)
    return ref, dmeta


def _prefill_inputs(h, kvh, d, chunks, dtype, device, block_size=None, seed=0):
    """Device tensors for one prefill step: each sequence's context in scattered blocks, its chunk in
    q/k/v (and, as after the layer's cache write, in the cache too)."""
    block_size = block_size or BLOCK_SIZE
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in chunks]
    nbs = [-(-n // block_size) for n in seq_lens]
    perm = torch.randperm(sum(nbs), generator=g)
    bt = torch.zeros(len(chunks), max(nbs), dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = perm[at:at + nb].int()
        at += nb
    kc = torch.randn(sum(nbs), block_size, kvh, d, generator=g).to(dtype).to(device)
    vc = torch.randn(sum(nbs), block_size, kvh, d, generator=g).to(dtype).to(device)
    t = sum(n for _, n in chunks)
    q = torch.randn(t, h, d, generator=g).to(dtype).to(device)
    k = torch.randn(t, kvh, d, generator=g).to(dtype).to(device)
    v = torch.randn(t, kvh, d, generator=g).to(dtype).to(device)
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([n for _, n in chunks]).cumsum(0)
    return q, k, v, kc, vc, bt.to(device), cu.to(device), torch.tensor(seq_lens, dtype=torch.int32).to(device)


def run_triton_bench(device, dtype, dname, timer, peak_gbs, peak_tflops, decode_cases=None, prefill_cases=None,
                     write_tokens=None, baseline=None):
    """Print one table per kernel. ``timer(fn) -> seconds``; the case lists default to the CUDA ones.
    ``baseline``: a module whose ``prefill_attention`` (same signature) is timed beside the current one."""
    import torch.nn.functional as F

    from pagoda_kernels.attention import write_kv
    from pagoda_kernels.triton_attention import (decode_num_splits, paged_decode_attention, prefill_attention,
                                                 reshape_and_cache)

    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 8
    print(f"\n== paged decode ({dname}, block size {BLOCK_SIZE}); floor = K/V bytes / {peak_gbs:.0f} GB/s")
    header = (f"{'model':8} {'H/KV/D':>10} {'batch':>5} {'ctx':>6} {'KV MB':>7} {'splits':>6} | {'floor us':>8} | "
              f"{'torch us':>9} {'GB/s':>6} | {'triton us':>9} {'GB/s':>6} {'%floor':>6} | {'max err':>8}")
    print(header)
    print("-" * len(header))
    for label, h, kvh, d, batch, ctx in decode_cases or CUDA_DECODE_CASES:
        q, kc, vc, meta = _decode_inputs(h, kvh, d, batch, ctx, dtype, device)
        scale = 1 / math.sqrt(d)
        bt, sl = meta.decode_block_tables.to(device), meta.decode_seq_lens.to(device)
        splits = decode_num_splits(batch, kvh, 1 if h // kvh <= 64 else -(-(h // kvh) // 64), ctx, num_sms)
        nbytes = 2 * batch * ctx * kvh * d * dtype.itemsize
        floor = nbytes / (peak_gbs * 1e9)

        def tri():
            return paged_decode_attention(q, kc, vc, bt, sl, scale, max_seq_len=ctx, num_sms=num_sms)

        ref, dmeta = _torch_decode_on(device, meta, BLOCK_SIZE)
        err = (tri().float() - ref.decode(q, kc, vc, dmeta, scale).float()).abs().max().item()
        t_tri = timer(tri)
        try:
            t_ref = timer(lambda: ref.decode(q, kc, vc, dmeta, scale))
            ref_cols = f"{t_ref * 1e6:9.1f} {nbytes / t_ref / 1e9:6.0f}"
        except torch.OutOfMemoryError:  # the gathered copy of K/V does not fit
            ref_cols = f"{'OOM':>9} {'':>6}"
        print(f"{label:8} {f'{h}/{kvh}/{d}':>10} {batch:5d} {ctx:6d} {nbytes / 1e6:7.1f} {splits:6d} | "
              f"{floor * 1e6:8.1f} | {ref_cols} | {t_tri * 1e6:9.1f} {nbytes / t_tri / 1e9:6.0f} "
              f"{100 * floor / t_tri:5.0f}% | {err:8.1e}", flush=True)
        del q, kc, vc, ref, dmeta

    print(f"\n== prefill ({dname}); floor = causal FLOPs / {peak_tflops:.0f} TFLOP/s; "
          f"SDPA = dense causal attention on the chunks' own tokens (no paging, no cached context); "
          f"per-head = gqa_pack=1 (one program per q head); triton = the default (GQA group packed)"
          + (f"; before = {baseline.__name__}" if baseline else ""))
    header = (f"{'model':8} {'H/KV/D':>10} {'chunks (context+query)':>24} {'GFLOP':>7} | {'floor us':>8} | "
              f"{'sdpa us':>8} | " + (f"{'before us':>9} {'%floor':>6} | " if baseline else "")
              + f"{'per-head us':>11} {'%floor':>6} | {'triton us':>9} {'TFLOP/s':>7} {'%floor':>6} | {'max err':>8}")
    print(header)
    print("-" * len(header))
    for label, h, kvh, d, chunks in prefill_cases or CUDA_PREFILL_CASES:
        q, k, v, kc, vc, bt, cu, sl = _prefill_inputs(h, kvh, d, chunks, dtype, device)
        scale = 1 / math.sqrt(d)
        max_q = max(n for _, n in chunks)
        # 2 matmuls x 2 FLOPs x D per (q head, query, visible key); query i of a chunk sees context + i + 1 keys.
        flops = sum(4 * h * d * (n * c + n * (n + 1) // 2) for c, n in chunks)
        floor = flops / (peak_tflops * 1e12)

        def tri():
            return prefill_attention(q, k, v, kc, vc, bt, cu, sl, scale, max_query_len=max_q)

        def per_head():
            return prefill_attention(q, k, v, kc, vc, bt, cu, sl, scale, max_query_len=max_q, gqa_pack=1)

        def before():
            return baseline.prefill_attention(q, k, v, kc, vc, bt, cu, sl, scale, max_query_len=max_q)

        def sdpa():
            outs, row = [], 0
            for _, n in chunks:
                qi, ki, vi = (x[row:row + n].transpose(0, 1)[None] for x in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True))
                row += n
            return outs

        o = tri()
        err = f"{'n/a':>8}"
        if all(c == 0 for c, _ in chunks):  # SDPA computes the same thing only without cached context
            worst, row = 0.0, 0
            for (_, n), ref_o in zip(chunks, sdpa()):
                worst = max(worst, (o[row:row + n].float() - ref_o[0].transpose(0, 1).float()).abs().max().item())
                row += n
            err = f"{worst:8.1e}"
        for other in (per_head,) + ((before,) if baseline else ()):  # same function, other launch
            worst = (other().float() - o.float()).abs().max().item()
            if not worst < 2e-2:
                print(f"!! {other.__name__} differs from the default launch by {worst:.1e}")
        t_tri = timer(tri)
        t_head = timer(per_head)
        t_before = timer(before) if baseline else None
        t_sdpa = timer(sdpa)
        desc = " ".join(f"{c}+{n}" for c, n in chunks[:2]) + (f" x{len(chunks)}" if len(chunks) > 2 else "")
        before_cols = f"{t_before * 1e6:9.1f} {100 * floor / t_before:5.0f}% | " if baseline else ""
        print(f"{label:8} {f'{h}/{kvh}/{d}':>10} {desc:>24} {flops / 1e9:7.1f} | {floor * 1e6:8.1f} | "
              f"{t_sdpa * 1e6:8.1f} | {before_cols}{t_head * 1e6:11.1f} {100 * floor / t_head:5.0f}% | "
              f"{t_tri * 1e6:9.1f} {flops / t_tri / 1e12:7.1f} {100 * floor / t_tri:5.0f}% | {err}", flush=True)
        del q, k, v, kc, vc

    print(f"\n== reshape_and_cache ({dname}, Llama-8B: 8 KV heads x 128); floor = read + write bytes / {peak_gbs:.0f} GB/s")
    header = f"{'tokens':>6} {'MB':>7} | {'floor us':>8} | {'index_copy us':>13} | {'triton us':>9} {'GB/s':>6}"
    print(header)
    print("-" * len(header))
    kvh, d = 8, 128
    for t in write_tokens or CUDA_WRITE_TOKENS:
        num_blocks = max(1024, 2 * t // BLOCK_SIZE)
        kc = torch.zeros(num_blocks, BLOCK_SIZE, kvh, d, dtype=dtype, device=device)
        vc = torch.zeros_like(kc)
        k = torch.randn(t, kvh, d, device=device).to(dtype)
        v = torch.randn(t, kvh, d, device=device).to(dtype)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:t]
        nbytes = 4 * t * kvh * d * dtype.itemsize
        t_tri = timer(lambda: reshape_and_cache(k, v, kc, vc, slots))
        t_ref = timer(lambda: write_kv(k, v, kc, vc, slots))
        print(f"{t:6d} {nbytes / 1e6:7.2f} | {nbytes / (peak_gbs * 1e9) * 1e6:8.2f} | {t_ref * 1e6:13.1f} | "
              f"{t_tri * 1e6:9.1f} {nbytes / t_tri / 1e9:6.0f}", flush=True)


def bench_cuda(args):
    import triton.testing

    if not torch.cuda.is_available():
        print("--device cuda: no CUDA device visible to torch; nothing to benchmark.")
        return
    device = torch.device("cuda")
    print(f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}; triton {triton.__version__}; "
          f"timing: triton.testing.do_bench ({args.stat}, L2 flushed between calls)")

    def timer(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode=args.stat) / 1e3

    baseline = importlib.import_module(args.prefill_baseline) if args.prefill_baseline else None
    for dname in args.dtype:
        run_triton_bench(device, DTYPES[dname], dname, timer, args.peak_gbs, args.peak_tflops, baseline=baseline)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--stat", default="median", choices=["median", "min"],
                   help="per-call time reported (min is steadier on a shared machine)")
    p.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (default: torch's)")
    p.add_argument("--dtype", nargs="+", default=None, choices=list(DTYPES),
                   help="default: bf16 fp32 on cpu, bf16 on cuda")
    p.add_argument("--peak-gbs", type=float, default=3350.0, help="cuda: HBM bandwidth for the floors (H100 SXM)")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="cuda: dense bf16/fp16 TFLOP/s (H100 SXM)")
    p.add_argument("--only", default=None, choices=["decode", "prefill", "layer_ops"], help="cpu: run one table")
    p.add_argument("--cpu-baseline", default=None, metavar="OLD.cpp",
                   help="cpu: also time the decode kernel of an older paged_attention_cpu.cpp, built separately")
    p.add_argument("--prefill-baseline", default=None, metavar="MODULE",
                   help="cuda: also time MODULE.prefill_attention (e.g. an older triton_attention.py copied "
                        "into kernels/ as pagoda_kernels.old_attention) for before/after in one run")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's, 64 cpu / 16 cuda)")
    args = p.parse_args(argv)
    if args.block_size is not None and args.block_size < 1:
        p.error(f"--block-size must be >= 1, got {args.block_size}")
    global BLOCK_SIZE
    BLOCK_SIZE = args.block_size or (16 if args.device == "cuda" else 64)
    if args.dtype is None:
        args.dtype = ["bf16"] if args.device == "cuda" else ["bf16", "fp32"]
    if args.device == "cuda":
        bench_cuda(args)
    else:
        bench_cpu(args)


if __name__ == "__main__":
    sys.exit(main())
