"""Output with prompt-lookup drafts against output without: W's first N requests batched, greedy.

    python bench/spec_outputs.py [--dtype bfloat16] [--requests 32] [--num-speculative-tokens 4]

Runs the requests (their own prompt and output lengths, ``ignore_eos``) through one ``LLM`` without
drafts and one with, and prints each run's seconds and accepted / proposed drafts, how many of the
requests came out identical, and where each other one parts. A verified draft position must
compute what a decode step at that position computes, bit for bit, or a near-tie (common in bf16 on
W's random prompts) resolves differently; bench/RESULTS.md, thirty-first session.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_runner import load_workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    args = ap.parse_args()
    if not 1 <= args.requests <= 256 or args.num_speculative_tokens < 1:
        ap.error("--requests must be in 1..256 and --num-speculative-tokens >= 1")

    from engine_service import LLM, SamplingParams

    requests = load_workload("W")[:args.requests]
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    runs = {}
    for k in (0, args.num_speculative_tokens):
        llm = LLM(dtype=args.dtype, num_speculative_tokens=k)
        t = time.perf_counter()
        runs[k] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        sched = llm.llm_engine.scheduler
        print(f"drafts of {k}: {time.perf_counter() - t:.1f} s, {sched.num_accepted_tokens} of "
              f"{sched.num_draft_tokens} draft tokens accepted")
        del llm
    plain, spec = runs[0], runs[args.num_speculative_tokens]
    same = sum(a == b for a, b in zip(plain, spec))
    print(f"{args.dtype}: {same} of {len(requests)} requests identical with and without drafts")
    for i, (a, b) in enumerate(zip(plain, spec)):
        if a != b:
            at = next((j for j in range(min(len(a), len(b))) if a[j] != b[j]), min(len(a), len(b)))
            print(f"  request {i} parts at output token {at}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
