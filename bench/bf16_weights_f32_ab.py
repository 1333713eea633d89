"""A bf16 model on the float32 kernel (CPUs without bf16 dot products): its bf16 weights packed for
the kernel as they are (``gemm_pack(w, float32_kernel=True)``, widened in registers inside the
GEMM) against float32 copies of them (what the engine kept before: on the same kernel for the
decoder layers, on oneDNN for the LM head), at the bundled model's shapes and W's row counts.

    python bench/bf16_weights_f32_ab.py [--rows 1 8 64 256 2048] [--shapes qkv o gate_up down lm] [--threads N]

Both forms on our kernel give the same bits (tests/test_layer_ops.py); the bf16 one holds half the
bytes. Each call reads the next of enough weight copies to fill 160 MB (more than the L3), so every
call's weight comes from DRAM as in a step of the engine, where 30 layers' weights pass between two
uses of one. bf16 x, as the model hands over. Rounds alternate the forms; prints the best of five
rounds of each as GFLOP/s, bf16 over the float32 copy on our kernel, and bf16 over oneDNN on the
float32 copy (> 1: the bf16 weights are faster). Needs AVX2 and FMA (the float32 kernel); on CPUs
with bf16 dot products the engine takes the bf16 kernel instead, but the float32 kernel runs there
too, so this measures it on any such host.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_service.models.llama import linear, pack_cpu_weight  # noqa: E402
from fp32_linear_ab import SHAPES, gemm_parser  # noqa: E402

COLD_BYTES = 160 << 20


def seconds(multiply, x, weights, reps: int) -> float:
    """Seconds for ``reps`` calls, each on the next weight of ``weights``, after one untimed call."""
    multiply(x, weights[-1])
    t = time.perf_counter()
    for i in range(reps):
        multiply(x, weights[i % len(weights)])
    return time.perf_counter() - t


def main() -> None:
    ap = gemm_parser(__doc__, [1, 8, 64, 256, 2048])
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
    print("| rows | weight | oneDNN, float32 copy GFLOP/s | ours, float32 copy | ours, bf16 | "
          "bf16 / float32 copy (ours) | bf16 (ours) / oneDNN |")
    print("|---|---|---|---|---|---|---|")
    multiply = {"onednn": lambda x, w: linear(x, w, packed=True), "f32": ops.gemm_linear, "bf16": ops.gemm_linear}
    for name in args.shapes:
        n, k = SHAPES[name]
        copies = -(-COLD_BYTES // (4 * n * k))
        ws = [(0.05 * torch.randn(n, k)).to(torch.bfloat16) for _ in range(copies)]
        forms = {"onednn": [pack_cpu_weight(w.float(), 256) for w in ws], "f32": [ops.gemm_pack(w.float()) for w in ws],
                 "bf16": [ops.gemm_pack(w, float32_kernel=True) for w in ws]}
        del ws
        for rows in args.rows:
            if name == "lm" and rows > 256:  # the LM head takes one row a sequence (max_num_seqs 256)
                continue
            x = torch.randn(rows, k).to(torch.bfloat16)
            reps = max(2 * copies, int(1e9 / (2 * rows * n * k)))
            times: dict[str, list[float]] = {key: [] for key in forms}
            for _ in range(5):
                for key in forms:
                    times[key].append(seconds(multiply[key], x, forms[key], reps))
            flop = 2 * rows * n * k * reps
            best = {key: min(v) for key, v in times.items()}
            rate = {key: f"{flop / t / 1e9:.1f}" for key, t in best.items()}
            print(f"| {rows} | {name} | {rate['onednn']} | {rate['f32']} | {rate['bf16']} | "
                  f"{best['f32'] / best['bf16']:.2f} | {best['onednn'] / best['bf16']:.2f} |", flush=True)
        del forms


if __name__ == "__main__":
    main()
