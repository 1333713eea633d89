"""The CPU decode kernel on one-byte K/V caches (float8_e5m2 and float8_e4m3fn, vLLM's
``kv_cache_dtype="fp8_e5m2"`` and ``"fp8"``; and int8 codes with a float32 scale a row, where the
build reads them) against a bf16 cache of the same values, calls alternating in one process.

    python bench/kv_fp8_decode.py [--reps 20] [--threads N] [--stat median|min] [--dtype float32] [--baseline OLD.cpp]
                                  [--hot]

Each case of bench/kernel_bench.py's CASES (SmolLM2 and Llama-8B shapes, every sequence at the
given context, scattered blocks) runs ``paged_decode_attention`` with bf16 queries (``--dtype
float32``: float32, AVX2 builds) on caches of that dtype and on their e5m2 and e4m3 codes, cycling
through enough layers' caches (``--cache-mb`` of bf16, half that of codes) that every call reads
from DRAM, the three calls in turn each repetition. Prints each one's milliseconds and the rate of
the bytes it reads (2 or 4 bytes a value, or 1), and the model dtype's time over each format's. They
give the same bits where the codes' values are what the bf16 cache holds (tests/test_cpu_attention.py);
here the bf16 cache holds random values, which the codes round. ``--baseline OLD.cpp`` (another
revision's kernels/csrc/paged_attention_cpu.cpp, built as its own extension) also runs its decode
kernel on the e5m2 and e4m3 codes (and the int8 ones, where this build reads them) in the same
turns: before / after on the coded caches in one process. ``--hot``: the arithmetic alone, one thread
(unless ``--threads``), small cases whose K/V stay in L2 (kernel_bench.HOT_CASES), each call's
caches those of the call before.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_bench  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch / OpenMP threads (default: torch's)")
    ap.add_argument("--stat", default="median", choices=["median", "min"])
    ap.add_argument("--cache-mb", type=int, default=512, help="bf16 K/V cycled through per case")
    ap.add_argument("--baseline", metavar="OLD.cpp", help="another paged_attention_cpu.cpp to time on the codes")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the queries' and model's")
    ap.add_argument("--hot", action="store_true", help="small cases with K/V in L2, one thread: the arithmetic alone")
    args = ap.parse_args()
    if args.hot:
        args.cache_mb = 0
        args.threads = args.threads or 1
    dtype = getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda_kernels.attention import quantize_int8_rows
    from pagoda_kernels.cpu_attention import decode_supports_f8, decode_supports_int8, paged_decode_attention

    if not decode_supports_f8(dtype):
        print(f"this build's decode kernel has no one-byte cache with {args.dtype} queries (bf16: AVX512-BF16 or "
              f"AVX2; float32: AVX2 builds)")
        return 1
    kernel_bench.MIN_CACHE_BYTES = args.cache_mb << 20
    baseline = kernel_bench.load_cpu_baseline(args.baseline) if args.baseline else None
    int8 = decode_supports_int8(dtype)
    name = {"bfloat16": "bf16", "float32": "fp32"}[args.dtype]
    print(f"paged decode, {name} queries, block size {kernel_bench.BLOCK_SIZE}, {torch.get_num_threads()} threads, "
          f"{args.stat} of {args.reps}")
    header = (f"{'model':8} {'H/KV/D':>10} {'batch':>5} {'ctx':>5} | {name + ' ms':>8} {'GB/s':>6} | "
              f"{'e5m2 ms':>8} {'GB/s':>6} | {'e4m3 ms':>8} {'GB/s':>6} | {name + ' / e5m2':>11} {name + ' / e4m3':>11}"
              + (f" | {'int8 ms':>8} {'GB/s':>6} {name + ' / int8':>11}" if int8 else "")
              + (" | before e5m2, e4m3 ms | before / e5m2, e4m3" if baseline else "")
              + (" | before int8 ms, before / int8" if baseline and int8 else ""))
    print(header)
    print("-" * len(header))
    prec = 4 if args.hot else 2  # ms digits
    for label, h, kvh, d, batch, ctx in kernel_bench.HOT_CASES if args.hot else kernel_bench.CASES:
        q, caches, meta, nbytes = kernel_bench.make_case(h, kvh, d, batch, ctx, dtype)
        codes = {f8: {id(k): (k.to(f8), v.to(f8)) for k, v in caches}
                 for f8 in (torch.float8_e5m2, torch.float8_e4m3fn)}
        if int8:  # codes and a scale a row: head_dim + 4 bytes
            codes["int8"] = {id(k): (quantize_int8_rows(k), quantize_int8_rows(v)) for k, v in caches}
        bt, sl, scale = meta.decode_block_tables, meta.decode_seq_lens, 1 / math.sqrt(d)
        out = torch.empty_like(q)
        paged_decode_attention(q, *caches[0], bt, sl, scale, out=out)  # (builds and loads the extension)
        # The op itself, as the baseline's is called: the Python wrapper's few µs would tilt --hot.
        op, nt = torch.ops.pagoda_cpu.paged_decode_attention, torch.get_num_threads()

        def model(k, v):
            op(q, k, v, bt, sl, scale, out, nt)

        def e5m2(k, v):
            op(q, *codes[torch.float8_e5m2][id(k)], bt, sl, scale, out, nt)

        def e4m3(k, v):
            op(q, *codes[torch.float8_e4m3fn][id(k)], bt, sl, scale, out, nt)

        def before_e5m2(k, v):
            baseline.paged_decode_attention(q, *codes[torch.float8_e5m2][id(k)], bt, sl, scale, out,
                                            torch.get_num_threads())

        def before_e4m3(k, v):
            baseline.paged_decode_attention(q, *codes[torch.float8_e4m3fn][id(k)], bt, sl, scale, out,
                                            torch.get_num_threads())

        def i8(k, v):
            op(q, *codes["int8"][id(k)], bt, sl, scale, out, nt)

        def before_i8(k, v):
            baseline.paged_decode_attention(q, *codes["int8"][id(k)], bt, sl, scale, out, torch.get_num_threads())

        fns = ([model, e5m2, e4m3] + ([i8] if int8 else []) + ([before_e5m2, before_e4m3] if baseline else [])
               + ([before_i8] if baseline and int8 else []))
        t16, t5, t4, *rest = kernel_bench.time_interleaved(fns, caches, args.reps, args.stat)
        t_i8, t_old = (rest[0], rest[1:]) if int8 else (None, rest)
        code_bytes = nbytes / dtype.itemsize
        i8_col = (f" | {t_i8 * 1e3:8.{prec}f} {code_bytes * (d + 4) / d / t_i8 / 1e9:6.1f} {t16 / t_i8:10.2f}x"
                  if int8 else "")
        old = (f" | {t_old[0] * 1e3:9.{prec}f}, {t_old[1] * 1e3:8.{prec}f} | {t_old[0] / t5:11.3f}x, {t_old[1] / t4:.3f}x"
               if baseline else "")
        if baseline and int8:
            old += f" | {t_old[2] * 1e3:8.{prec}f}, {t_old[2] / t_i8:.3f}x"
        print(f"{label:8} {f'{h}/{kvh}/{d}':>10} {batch:5d} {ctx:5d} | {t16 * 1e3:8.{prec}f} {nbytes / t16 / 1e9:6.1f} | "
              f"{t5 * 1e3:8.{prec}f} {code_bytes / t5 / 1e9:6.1f} | {t4 * 1e3:8.{prec}f} {code_bytes / t4 / 1e9:6.1f} | "
              f"{t16 / t5:10.2f}x {t16 / t4:10.2f}x{i8_col}{old}", flush=True)
        del caches, codes
    return 0


if __name__ == "__main__":
    sys.exit(main())
