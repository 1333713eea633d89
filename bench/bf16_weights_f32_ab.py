"""A bf16 model on the float32 kernel (CPUs without bf16 dot products): its bf16 weights packed for
the kernel as they are (``gemm_pack(w, float32_kernel=True)``, widened block by block inside the
GEMM) against float32 copies of them (what the engine kept before), at the bundled model's layer
shapes and W's row counts.

    python bench/bf16_weights_f32_ab.py [--rows 1 8 64 256 2048] [--shapes qkv o gate_up down] [--threads N]

Both forms give the same bits (tests/test_layer_ops.py); the bf16 one holds half the bytes. Each
call reads the next of enough weight copies to fill 160 MB (more than the L3), so every call's
weight comes from DRAM as in a step of the engine, where 30 layers' weights pass between two uses
of one. bf16 x, as the model hands over. Rounds alternate the two forms; prints the best of five
rounds of each as GFLOP/s and bf16 over float32 (> 1: the bf16 weights are faster). Needs AVX2 and
FMA (the float32 kernel); on CPUs with bf16 dot products the engine takes the bf16 kernel instead,
but the float32 kernel runs there too, so this measures it on any such host.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fp32_linear_ab import SHAPES  # noqa: E402

COLD_BYTES = 160 << 20


def seconds(ops, x, weights, reps: int) -> float:
    """Seconds for ``reps`` calls, each on the next weight of ``weights``, after one untimed call."""
    ops.gemm_linear(x, weights[-1])
    t = time.perf_counter()
    for i in range(reps):
        ops.gemm_linear(x, weights[i % len(weights)])
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 2048])
    ap.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate_up", "down"],
                    choices=[s for s in SHAPES if s != "lm"])
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda_kernels.layer_ops import CpuLayerOps

    ops = CpuLayerOps()
    if not ops.f32_gemm:
        raise SystemExit("this CPU has no AVX2 and FMA: no float32 kernel")
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; weights cycled over {COLD_BYTES >> 20} MB of float32 copies")
    print("| rows | weight | float32 copies GFLOP/s | bf16 weights GFLOP/s | bf16 / float32 |")
    print("|---|---|---|---|---|")
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = -(-COLD_BYTES // (4 * n * k))
        ws = [(0.05 * torch.randn(n, k)).to(torch.bfloat16) for _ in range(copies)]
        forms = {"f32": [ops.gemm_pack(w.float()) for w in ws],
                 "bf16": [ops.gemm_pack(w, float32_kernel=True) for w in ws]}
        del ws
        for rows in args.rows:
            x = torch.randn(rows, k).to(torch.bfloat16)
            reps = max(2 * copies, int(1e9 / (2 * rows * n * k)))
            times: dict[str, list[float]] = {"f32": [], "bf16": []}
            for _ in range(5):
                for key in ("f32", "bf16"):
                    times[key].append(seconds(ops, x, forms[key], reps))
            flop = 2 * rows * n * k * reps
            best = {key: min(v) for key, v in times.items()}
            print(f"| {rows} | {name} | {flop / best['f32'] / 1e9:.1f} | {flop / best['bf16'] / 1e9:.1f} | "
                  f"{best['f32'] / best['bf16']:.2f} |", flush=True)
        del forms


if __name__ == "__main__":
    main()
