"""float32 GEMMs: the engine's oneDNN-packed weights against torch's F.linear on the plain weight
(MKL's sgemm in torch's CPU wheels), at the bundled model's weight shapes and W's row counts.

    python bench/fp32_linear_ab.py [--rows 8 64 256 1024 2048] [--shapes qkv o gate_up down lm]

Both run on the same inputs, alternating, best of five rounds of enough calls for ~2 GFLOP each.
Prints each form's GFLOP/s and the ratio (> 1: the packed weight faster). The engine packs every
float32 weight (``pack_cpu_weight``); bench/RESULTS.md (twenty-fourth session) reads this on an
AVX2-only host, where the plain weight was 3-15% faster at 2048 rows, yet running those steps on it
gained no clear time over W.
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


def seconds(fn, reps: int) -> float:
    """Seconds for ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256, 1024, 2048])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}")
    print("| rows | weight | F.linear GFLOP/s | packed GFLOP/s | packed / F.linear |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        for name in args.shapes:
            n, k = SHAPES[name]
            w, x = torch.randn(n, k), torch.randn(rows, k)
            packed = pack_cpu_weight(w, 256)
            if packed is None:
                raise SystemExit("this torch build has no oneDNN")
            reps = max(3, int(2e9 / (2 * rows * n * k)))
            plain_s, packed_s = [], []
            for _ in range(5):
                plain_s.append(seconds(lambda: F.linear(x, w), reps))
                packed_s.append(seconds(lambda: linear(x, packed, packed=True), reps))
            flop = 2 * rows * n * k * reps
            a, b = min(plain_s), min(packed_s)
            print(f"| {rows} | {name} | {flop / a / 1e9:.1f} | {flop / b / 1e9:.1f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
