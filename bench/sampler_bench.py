"""The sampler on a decode step's logits: its torch path against the C++ kernels the engine takes on
CPU (``CpuLayerOps.sample`` and ``CpuLayerOps.logprobs``), per sampling setting.

    python bench/sampler_bench.py [--rows 256] [--vocab 49152] [--reps 7]

Logits: bf16 [rows, vocab] as the LM head hands them over (random, scaled so a few dozen tokens
carry most of the mass at temperature 0.8). Each setting samples every row with the same
``SamplingParams`` (with 300 prompt and 100 output tokens a row, for the penalties). Both forms run
in this process, alternating, with the engine's malloc settings; prints the median milliseconds of
each and their ratio. A 256-row decode step of the bundled model takes ~150 ms on a 2-core Zen 5.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_service import cpu_malloc  # noqa: E402
from engine_service.sampler import Sampler, SamplingBatch  # noqa: E402
from engine_service.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "top_k 50": dict(temperature=0.8, top_k=50),
    "top_k 50, top_p 0.95": dict(temperature=0.8, top_k=50, top_p=0.95),
    "min_p 0.05": dict(temperature=0.8, min_p=0.05),
    "repetition_penalty 1.1": dict(temperature=0.8, repetition_penalty=1.1),
    "presence 0.5, frequency 0.5": dict(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.5),
    "greedy, logprobs 0": dict(temperature=0.0, logprobs=0),
    "greedy, logprobs 5": dict(temperature=0.0, logprobs=5),
    "top_p 0.95, logprobs 20": dict(temperature=0.8, top_p=0.95, logprobs=20),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    cpu_malloc.tune_for_engine()
    from pagoda_kernels.layer_ops import CpuLayerOps

    ops = CpuLayerOps()
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=g) * 2.5).to(torch.bfloat16)
    forms = {"torch": Sampler(args.vocab, {2}, argmax=ops.argmax),
             "kernel": Sampler(args.vocab, {2}, argmax=ops.argmax, sample=ops.sample, logprobs=ops.logprobs)}
    print(f"torch threads {torch.get_num_threads()}; {args.rows} rows x {args.vocab} bf16 logits; "
          f"median of {args.reps}")
    print("| setting | torch path ms | kernel ms | torch / kernel |")
    print("|---|---|---|---|")
    for name, fields in SETTINGS.items():
        batch = SamplingBatch(params=[SamplingParams(**fields)] * args.rows,
                              prompt_token_ids=[list(range(300))] * args.rows,
                              output_token_ids=[list(range(1000, 1100))] * args.rows,
                              generators=[None] * args.rows)
        times: dict[str, list[float]] = {key: [] for key in forms}
        for _ in range(args.reps):
            for key, sampler in forms.items():
                t = time.perf_counter()
                sampler(logits, batch)
                times[key].append(time.perf_counter() - t)
        a, b = (statistics.median(times[key]) * 1e3 for key in forms)
        print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
