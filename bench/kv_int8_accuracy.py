"""How close the CPU decode kernel's output on a one-byte or int8 K/V cache comes to the exact
attention on the values that cache holds, against that exact result's own rounding to bf16.

    python bench/kv_int8_accuracy.py [--baseline OLD.cpp]

For SmolLM2's and Llama-8B's shapes and one with a half-width chunk (head_dim 80): 16 sequences of
700 tokens at scattered blocks, bf16 queries at 3x kernel_bench's (a sharper softmax), caches of
random bf16 values and their int8 codes (a scale a row) and e4m3 codes (the values e4m3 holds as
the kernel reads them: subnormals as zero where it flushes them). Prints each kernel's mean
and largest |output - float64 attention on the codes' values|, and the mean |bf16(exact) - exact|:
a kernel whose products are exact and whose rounding is finer than bf16 operands' lands at the
last. ``--baseline OLD.cpp``: another revision's kernels/csrc/paged_attention_cpu.cpp, built as its
own extension, on the same inputs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_bench  # noqa: E402

SHAPES = [(9, 3, 64), (32, 8, 128), (8, 2, 80)]
BATCH, CONTEXT, SCALE = 16, 700, 0.125


def exact(q, kc, vc, bt, sl):
    """softmax(q k^T * SCALE) v in float64 for each sequence, K/V [blocks, block_size, kvh, d] values."""
    b, h, d = q.shape
    kvh, bs = kc.shape[2], kc.shape[1]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        pos = torch.arange(int(sl[i]))
        blocks = bt[i].long()[pos // bs]
        k = kc[blocks, pos % bs].double().permute(1, 2, 0)  # [kvh, d, n]
        v = vc[blocks, pos % bs].double().transpose(0, 1)  # [kvh, n, d]
        s = torch.matmul(q[i].double().view(kvh, h // kvh, d), k) * SCALE
        out[i] = torch.matmul(s.softmax(-1), v).reshape(h, d)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", metavar="OLD.cpp", help="another paged_attention_cpu.cpp on the same inputs")
    args = ap.parse_args()
    from pagoda_kernels.attention import dequantize_int8_rows, quantize_int8_rows
    from pagoda_kernels.cpu_attention import (decode_f8_flushes_subnormals, decode_supports_f8, decode_supports_int8,
                                              paged_decode_attention)

    if not decode_supports_f8(torch.bfloat16):
        print("this build's decode kernel reads no one-byte cache with bf16 queries")
        return 1
    kernel_bench.MIN_CACHE_BYTES = 1  # one layer's caches
    baseline = kernel_bench.load_cpu_baseline(args.baseline) if args.baseline else None
    print(f"{'H/KV/D':>10} {'cache':>5} | {'bf16(exact)':>11} | {'mean |err|':>10} {'max':>9}"
          + (f" | {'before mean':>11} {'max':>9}" if baseline else ""))
    for h, kvh, d in SHAPES:
        q, caches, meta, _ = kernel_bench.make_case(h, kvh, d, BATCH, CONTEXT, torch.bfloat16, seed=d)
        q = (q.float() * 3).to(torch.bfloat16)
        k, v = caches[0]
        bt, sl = meta.decode_block_tables, meta.decode_seq_lens
        flush = decode_f8_flushes_subnormals(torch.bfloat16)  # e4m3 codes below 2^-6 read as zero

        def e4m3_values(c):
            x = c.to(torch.bfloat16)
            return x.masked_fill(x.abs() < 2.0 ** -6, 0.0) if flush else x
        coded = {"e4m3": ((k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)), e4m3_values)}
        if decode_supports_int8(torch.bfloat16):
            coded["int8"] = ((quantize_int8_rows(k), quantize_int8_rows(v)), dequantize_int8_rows)
        for name, ((kc, vc), values) in coded.items():
            want = exact(q, values(kc), values(vc), bt, sl)
            rounding = (want.to(torch.bfloat16).double() - want).abs().mean()
            out = torch.empty_like(q)
            paged_decode_attention(q, kc, vc, bt, sl, SCALE, out=out)
            err = (out.double() - want).abs()
            line = f"{f'{h}/{kvh}/{d}':>10} {name:>5} | {rounding:11.3e} | {err.mean():10.3e} {err.max():9.2e}"
            if baseline:
                baseline.paged_decode_attention(q, kc, vc, bt, sl, SCALE, out, 1)
                old = (out.double() - want).abs()
                line += f" | {old.mean():11.3e} {old.max():9.2e}"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
