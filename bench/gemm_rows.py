"""How oneDNN's packed GEMM time depends on the row count, for the bundled model's weight shapes.

    python bench/gemm_rows.py [--dtype bfloat16] [--shapes qkv o gate_up down lm] [--reps 11]

For each weight shape and row count M, times one call on all M rows against the same rows split
into calls of 128, 256 and 512 rows, through the engine's own ``linear`` on weights packed the
engine's way (``pack_cpu_weight``, batch hint 256: oneDNN's block-32 layout on AMX) and in the
block-64 layout a batch hint of 1 gives. Several
weights are cycled so that the timings are not of one cache-hot weight. Prints each split's speed
relative to the single call (> 1: faster) and the best. A row count where the best is far above
1 is one where oneDNN's own blocking is poor; bench/RESULTS.md says which of them a W run meets.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_service.models.llama import linear, pack_cpu_weight  # noqa: E402

# SmolLM2-135M: hidden 576, 9 + 2 x 3 heads of 64 (QKV 960), intermediate 1536 (gate + up 3072), vocab 49152.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm": (49152, 576)}
LAYER_ROWS = [64, 128, 192, 224, 256, 320, 448, 576, 704, 832, 960, 1088, 1216, 1472, 1728, 2048]
LM_ROWS = list(range(64, 513, 64))


def median_seconds(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=11)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if not torch.backends.mkldnn.is_available():
        print("this torch build has no oneDNN")
        return 1
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu capability "
          f"{torch.backends.cpu.get_cpu_capability()}, {args.dtype}")
    torch.manual_seed(0)
    for name in args.shapes:
        n, k = SHAPES[name]
        nw = 1 if name == "lm" else 8
        raw = [torch.randn(n, k).to(dtype) for _ in range(nw)]
        layouts = {"b32": [pack_cpu_weight(w, 256) for w in raw], "b64": [pack_cpu_weight(w, 1) for w in raw]}
        turn = [0]
        for m in LM_ROWS if name == "lm" else LAYER_ROWS:
            x = torch.randn(m, k).to(dtype)
            res = {}
            for layout, ws in layouts.items():
                for c in (m, 128, 256, 512):
                    if c > m or (c != m and (layout, c) in res):
                        continue

                    def run(ws=ws, c=c):
                        turn[0] += 1
                        w = ws[turn[0] % nw]
                        for i in range(0, m, c):
                            linear(x[i:i + c], w, packed=True)

                    res[(layout, c if c < m else "all")] = median_seconds(run, args.reps)
            base = res[("b32", "all")]
            best = min(res, key=res.get)
            others = " ".join(f"{lay}/{c}:{base / s:.2f}" for (lay, c), s in res.items() if (lay, c) != ("b32", "all"))
            print(f"{name:8s} M={m:5d} one call {base * 1e6:7.0f} us | {others} | best {best[0]}/{best[1]} "
                  f"{base / res[best]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
