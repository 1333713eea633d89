"""float32 GEMMs: the engine's oneDNN-packed weights, Pagoda's own float32 GEMM (AVX-512 or AVX2;
where the CPU has AVX2 and FMA) and torch's F.linear on the plain weight (MKL's sgemm in torch's CPU wheels),
at the bundled model's weight shapes and W's row counts.

    python bench/fp32_linear_ab.py [--rows 8 64 256 1024 2048] [--shapes qkv o gate_up down lm lm_argmax] [--threads N]

All run on the same inputs, alternating, best of five rounds of enough calls for ~2 GFLOP each.
Prints each form's GFLOP/s and the ratios to oneDNN's (> 1: faster than oneDNN). The engine packs
every float32 weight for oneDNN (``pack_cpu_weight``) and, on CPUs with AVX2 and FMA, the decoder
layers' weights for Pagoda's GEMM instead (``EngineConfig.cpu_f32_gemm``); bench/RESULTS.md reads
this on an AVX2-only host (the twenty-fourth and twenty-seventh sessions) and on Zen 4 (the
twenty-ninth). ``lm_argmax`` is the LM head of a greedy step: each form's GEMM followed by the argmax
of its logits (``CpuLayerOps.argmax``), and Pagoda's with the argmax inside (``gemm_linear_argmax``,
the logits never written), as a float32 model's tied head runs where our GEMM is built.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_service.models.llama import linear, pack_cpu_weight  # noqa: E402

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm": (49152, 576)}
ARGMAX_SHAPES = {"lm_argmax": (49152, 576)}  # this bench's only: the GEMM and then the argmax


def gemm_parser(doc: str, rows: list[int], shapes: dict = SHAPES) -> argparse.ArgumentParser:
    """The GEMM benches' shared options: --rows (row counts, default ``rows``) and --shapes (names
    of ``shapes``, all by default)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=rows)
    ap.add_argument("--shapes", nargs="+", default=list(shapes), choices=list(shapes))
    return ap


def seconds(fn, reps: int) -> float:
    """Seconds for ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


def main() -> None:
    ap = gemm_parser(__doc__, [8, 64, 256, 1024, 2048], {**SHAPES, **ARGMAX_SHAPES})
    ap.add_argument("--threads", type=int, default=None, help="torch / OpenMP threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagoda_kernels.layer_ops import CpuLayerOps

    ops = CpuLayerOps()
    ours = ops.f32_gemm
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}; Pagoda's float32 GEMM {'on' if ours else 'not built (no AVX2 + FMA)'}")
    print("| rows | weight | oneDNN GFLOP/s | Pagoda GFLOP/s | F.linear GFLOP/s | Pagoda / oneDNN | F.linear / oneDNN |")
    print("|---|---|---|---|---|---|---|")
    for rows in args.rows:
        for name in args.shapes:
            n, k = {**SHAPES, **ARGMAX_SHAPES}[name]
            w, x = torch.randn(n, k), torch.randn(rows, k)
            packed = pack_cpu_weight(w, 256)
            if packed is None:
                raise SystemExit("this torch build has no oneDNN")
            gemm = ops.gemm_pack(w) if ours else None
            forms = {"onednn": lambda: linear(x, packed, packed=True), "plain": lambda: F.linear(x, w)}
            if ours:
                forms["pagoda"] = lambda: ops.gemm_linear(x, gemm)
            if name in ARGMAX_SHAPES:
                forms = {key: (lambda f=f: ops.argmax(f())) for key, f in forms.items()}
                if ours:
                    forms["pagoda"] = lambda: ops.gemm_linear_argmax(x, gemm, n)
                    tokens = {key: f() for key, f in forms.items()}
                    if not torch.equal(tokens["pagoda"], tokens["onednn"]):
                        print(f"note: {int((tokens['pagoda'] != tokens['onednn']).sum())} of {rows} rows' "
                              "argmax differ from oneDNN's (other sums' rounding on random data)")
            reps = max(3, int(2e9 / (2 * rows * n * k)))
            times: dict[str, list[float]] = {key: [] for key in forms}
            for _ in range(5):
                for key, f in forms.items():
                    times[key].append(seconds(f, reps))
            flop = 2 * rows * n * k * reps
            best = {key: min(v) for key, v in times.items() if v}
            rate = {key: f"{flop / s / 1e9:.1f}" for key, s in best.items()}
            ratio = {key: f"{best['onednn'] / s:.2f}" for key, s in best.items()}
            print(f"| {rows} | {name} | {rate['onednn']} | {rate.get('pagoda', '—')} | {rate['plain']} | "
                  f"{ratio.get('pagoda', '—')} | {ratio['plain']} |", flush=True)


if __name__ == "__main__":
    main()
