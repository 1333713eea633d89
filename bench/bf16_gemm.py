"""Pagoda's bf16 GEMMs (CpuLayerOps.gemm_*) against oneDNN's packed linear, SmolLM2's layer shapes.

    python bench/bf16_gemm.py [--rows 8,64,256,1024,2048] [--reps 11]

For each row count, median microseconds of one call, with the inputs and weight hot (the same call
just before) and cold (a 256 MB buffer written in between, as a decode step's K/V reads leave the
caches): o_proj and down_proj alone; gate/up with silu * up (oneDNN GEMM, then the C++ silu_and_mul,
against gemm_linear_silu_mul); QKV with rotary and the K/V cache write (oneDNN GEMM, then
rotary_qkv_to_cache, against gemm_linear_rotary_qkv_to_cache). Prints the ratio oneDNN / ours (> 1:
ours faster); CpuLayerOps.gemm_max_rows and the fused paths follow from it (bench/RESULTS.md). Needs
a CPU with AVX512-BF16 (the dot-product kernel) or AMX-BF16 (the tiles). Named amx_gemm.py before
the nineteenth session.

With AMX, "cold" also pays a warm-up of the AMX unit after the ~10 ms of vector code that writes the
buffer (an 8-row o_proj: ~160 us cold against ~45 us when an 8-row GEMM on another weight runs just
before it). ``--warm-amx`` adds that GEMM between the buffer and the timed call, leaving the cost
of the cold weight and inputs alone. In the engine the GEMM after decode attention sits between
the two: keeping the unit busy during the attention did not speed it up (bench/RESULTS.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_service.models.llama import linear, pack_cpu_weight  # noqa: E402
from pagoda_kernels.layer_ops import CpuLayerOps, interleave_gate_up  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64


def median_us(fn, cold, reps: int) -> float:
    ts = []
    for _ in range(reps):
        cold() if cold else fn()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8,64,256,1024,2048")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--warm-amx", action="store_true",
                    help="cold: run an 8-row GEMM of ours on another weight after the buffer write")
    args = ap.parse_args()
    ops = CpuLayerOps()
    if not ops.bf16_gemm:
        sys.exit("this CPU has neither AVX512-BF16 nor AMX-BF16")
    g = torch.Generator().manual_seed(0)
    flush = torch.empty(64 << 20, dtype=torch.float32)

    warm = []  # --warm-amx: (x, weight) of the GEMM run after the buffer write

    def cold():
        flush.add_(1.0)
        for x_warm, w_warm in warm:
            ops.gemm_linear(x_warm, w_warm)

    def weight(n, k):
        return (0.05 * torch.randn(n, k, generator=g)).to(torch.bfloat16)

    w_o, w_down, w_gu, w_qkv = (weight(HIDDEN, HIDDEN), weight(HIDDEN, INTER), weight(2 * INTER, HIDDEN),
                                weight((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN))
    dnnl = {name: pack_cpu_weight(w, 256) for name, w in (("o", w_o), ("down", w_down), ("gu", w_gu), ("qkv", w_qkv))}
    ours = {"o": ops.gemm_pack(w_o), "down": ops.gemm_pack(w_down), "gu": ops.gemm_pack(interleave_gate_up(w_gu)),
           "qkv": ops.gemm_pack(w_qkv)}
    if args.warm_amx:
        warm.append((torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16), ops.gemm_pack(weight(64, HIDDEN))))
    cos_t, sin_t = torch.randn(4096, HEAD_DIM), torch.randn(4096, HEAD_DIM)
    caches = [torch.zeros(2048, 64, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16) for _ in range(2)]
    print("| rows | case | oneDNN hot us | ours hot us | ratio | oneDNN cold us | ours cold us | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, HIDDEN, generator=g).to(torch.bfloat16)
        xi = torch.randn(m, INTER, generator=g).to(torch.bfloat16)
        rope = ops.rope_inputs(torch.randint(0, 4096, (m,), generator=g), cos_t, sin_t, torch.bfloat16)
        slots = torch.randperm(2048 * 64, generator=g)[:m]
        cases = {
            "o_proj": (lambda: linear(x, dnnl["o"], packed=True), lambda: ops.gemm_linear(x, ours["o"])),
            "down_proj": (lambda: linear(xi, dnnl["down"], packed=True), lambda: ops.gemm_linear(xi, ours["down"])),
            "gate/up + silu*up": (lambda: ops.silu_and_mul(linear(x, dnnl["gu"], packed=True)),
                                  lambda: ops.gemm_linear_silu_mul(x, ours["gu"])),
            "QKV + rotary + KV write": (
                lambda: ops.rotary_qkv_to_cache(linear(x, dnnl["qkv"], packed=True), rope, HEADS, *caches, slots),
                lambda: ops.gemm_linear_rotary_qkv_to_cache(x, ours["qkv"], rope, HEADS, *caches, slots)),
        }
        for name, (ref, new) in cases.items():
            hot = [median_us(f, None, args.reps) for f in (ref, new)]
            cld = [median_us(f, cold, args.reps) for f in (ref, new)]
            print(f"| {m} | {name} | {hot[0]:.0f} | {hot[1]:.0f} | {hot[0] / hot[1]:.2f} | {cld[0]:.0f} | "
                  f"{cld[1]:.0f} | {cld[0] / cld[1]:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
