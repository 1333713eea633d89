"""Sweep the Triton kernels' launch parameters on a CUDA GPU and print the best per shape.

    python bench/triton_sweep.py [--out sweep.json] [--quick]

For each decode case (bench/kernel_bench.py's CUDA cases) it times BLOCK_N x num_warps x num_stages x
split count (the heuristic's choice, half and double it); for each prefill case BLOCK_M (query rows)
x BLOCK_N x num_warps x num_stages, with the GQA group packed into the query tile (and, with
``--prefill-packs both``, one program per q head too). Every configuration is checked against the default one's output before
it is timed (a configuration that changes the result is reported, not ranked). Timing:
``triton.testing.do_bench`` median, L2 flushed between calls. The defaults at the top of
``kernels/triton_attention.py`` come from this sweep (kernels/README.md has the table).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import CUDA_DECODE_CASES, CUDA_PREFILL_CASES, _decode_inputs, _prefill_inputs  # noqa: E402

BLOCK_SIZE = 16  # the engine's KV block size on CUDA


def main() -> int:
    import triton
    import triton.testing

    from pagoda_kernels.triton_attention import (decode_num_splits, paged_decode_attention, prefill_attention,
                                                 prefill_gqa_pack)

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="write every timing as JSON here")
    p.add_argument("--quick", action="store_true", help="a smaller grid")
    p.add_argument("--kernels", nargs="+", default=["decode", "prefill"], choices=["decode", "prefill"])
    p.add_argument("--prefill-packs", default="packed", choices=["packed", "both"],
                   help="prefill: sweep the packed launch only, or per-head (gqa_pack=1) too")
    p.add_argument("--peak-gbs", type=float, default=3350.0)
    p.add_argument("--peak-tflops", type=float, default=989.0)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device visible to torch; nothing to sweep")
        return 1
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    dtype = torch.bfloat16
    print(f"{torch.cuda.get_device_name(dev)}; torch {torch.__version__}; triton {triton.__version__}; "
          f"{num_sms} SMs", flush=True)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") / 1e3

    results = {"decode": [], "prefill": []}
    print("\n== decode: best configurations (bf16, block size 16)")
    for label, h, kvh, d, batch, ctx in CUDA_DECODE_CASES if "decode" in args.kernels else []:
        q, kc, vc, meta = _decode_inputs(h, kvh, d, batch, ctx, dtype, dev, block_size=BLOCK_SIZE)
        bt, sl = meta.decode_block_tables.to(dev), meta.decode_seq_lens.to(dev)
        scale = 1 / math.sqrt(d)
        heur = decode_num_splits(batch, kvh, 1, ctx, num_sms)
        ref = paged_decode_attention(q, kc, vc, bt, sl, scale, max_seq_len=ctx, num_sms=num_sms).float()
        nbytes = 2 * batch * ctx * kvh * d * dtype.itemsize
        splits = sorted({max(1, heur // 2), heur, min(128, heur * 2)} | ({heur * 4} if heur * 4 <= 128 else set()))
        grid = itertools.product([32, 64, 128], [2, 4, 8], [1, 2, 3, 4], splits)
        if args.quick:
            grid = itertools.product([64, 128], [4, 8], [2, 3], splits)
        rows = []
        for block_n, warps, stages, ns in grid:
            def fn():
                return paged_decode_attention(q, kc, vc, bt, sl, scale, num_splits=ns, block_n=block_n,
                                              num_warps=warps, num_stages=stages)
            try:
                err = (fn().float() - ref).abs().max().item()
                t = bench(fn)
            except Exception as e:  # noqa: BLE001  (out of shared memory / registers for this shape)
                rows.append(dict(block_n=block_n, warps=warps, stages=stages, splits=ns, error=str(e)[:80]))
                continue
            rows.append(dict(block_n=block_n, warps=warps, stages=stages, splits=ns, us=t * 1e6, err=err,
                             gbs=nbytes / t / 1e9))
        ok = sorted((r for r in rows if "us" in r and r["err"] < 2e-2), key=lambda r: r["us"])
        default = next(r for r in rows if r.get("block_n") == 64 and r["warps"] == 4 and r["stages"] == 2
                       and r["splits"] == heur and "us" in r)
        floor = nbytes / (args.peak_gbs * 1e9) * 1e6
        print(f"{label} H{h}/KV{kvh}/D{d} batch {batch} ctx {ctx}: floor {floor:.1f} us; default (64,4,2,"
              f"{heur}) {default['us']:.1f} us {default['gbs']:.0f} GB/s", flush=True)
        for r in ok[:4]:
            print(f"    BLOCK_N {r['block_n']:3d} warps {r['warps']} stages {r['stages']} splits {r['splits']:3d}: "
                  f"{r['us']:8.1f} us {r['gbs']:5.0f} GB/s ({100 * floor / r['us']:.0f}% of floor)", flush=True)
        bad = [r for r in rows if "us" in r and r["err"] >= 2e-2]
        if bad:
            print(f"    !! {len(bad)} configurations changed the result, e.g. {bad[0]}")
        results["decode"].append(dict(case=[label, h, kvh, d, batch, ctx], heuristic_splits=heur, rows=rows))
        del q, kc, vc

    print("\n== prefill: best configurations (bf16)")
    for label, h, kvh, d, chunks in CUDA_PREFILL_CASES if "prefill" in args.kernels else []:
        q, k, v, kc, vc, bt, cu, sl = _prefill_inputs(h, kvh, d, chunks, dtype, dev, block_size=BLOCK_SIZE)
        scale = 1 / math.sqrt(d)
        max_q = max(n for _, n in chunks)
        flops = sum(4 * h * d * (n * c + n * (n + 1) // 2) for c, n in chunks)
        ref = prefill_attention(q, k, v, kc, vc, bt, cu, sl, scale, max_query_len=max_q).float()
        group = h // kvh
        packs = [prefill_gqa_pack(group)] + ([1] if args.prefill_packs == "both" and group > 1 else [])
        grid = itertools.product([64, 128], [32, 64, 128], [4, 8], [2, 3, 4], packs)
        if args.quick:
            grid = itertools.product([64, 128], [64, 128], [4, 8], [2, 3], packs)
        rows = []
        for block_m, block_n, warps, stages, pack in grid:
            def fn():
                return prefill_attention(q, k, v, kc, vc, bt, cu, sl, scale, max_query_len=max_q, block_m=block_m,
                                         block_n=block_n, num_warps=warps, num_stages=stages, gqa_pack=pack)
            cfg = dict(block_m=block_m, block_n=block_n, warps=warps, stages=stages, pack=pack)
            try:
                err = (fn().float() - ref).abs().max().item()
                t = bench(fn)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(cfg, error=str(e)[:80]))
                continue
            rows.append(dict(cfg, us=t * 1e6, err=err, tflops=flops / t / 1e12))
        ok = sorted((r for r in rows if "us" in r and r["err"] < 2e-2), key=lambda r: r["us"])
        # The launcher's defaults (prefill_attention's tile rule), timed in the same way.
        def default_fn():
            return prefill_attention(q, k, v, kc, vc, bt, cu, sl, scale, max_query_len=max_q)
        t_def = bench(default_fn)
        floor = flops / (args.peak_tflops * 1e12) * 1e6
        desc = " ".join(f"{c}+{n}" for c, n in chunks[:2]) + (f" x{len(chunks)}" if len(chunks) > 2 else "")
        print(f"{label} {desc}: floor {floor:.1f} us; default launch {t_def * 1e6:.1f} us "
              f"{flops / t_def / 1e12:.0f} TFLOP/s", flush=True)
        for r in ok[:4]:
            print(f"    BLOCK_M {r['block_m']:3d} BLOCK_N {r['block_n']:3d} warps {r['warps']} stages {r['stages']} "
                  f"pack {r['pack']}: {r['us']:8.1f} us {r['tflops']:5.0f} TFLOP/s ({100 * floor / r['us']:.0f}% "
                  f"of floor)", flush=True)
        results["prefill"].append(dict(case=[label, h, kvh, d, chunks], default_us=t_def * 1e6, rows=rows))
        del q, k, v, kc, vc

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
