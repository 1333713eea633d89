"""What constrained requests cost the unconstrained requests that share their batch.

    python bench/structured_overhead.py                       # 24 unconstrained + 8 companions, 48 tokens
    python bench/structured_overhead.py --unconstrained 48 --companions 16 --tokens 64 --repeats 3

One engine, two kinds of run on the same rows, alternated ``--repeats`` times (A B A B ...):
- A: ``--unconstrained`` greedy rows + ``--companions`` sampled rows with no constraint;
- B: the same unconstrained rows + the same companions, each under a structured output (JSON-shaped
  regex, a GBNF grammar, a JSON schema, alternating).
Every row generates exactly ``--tokens`` tokens in both runs (``ignore_eos``; companions use
``min_tokens`` and constraints that can always continue, so no companion ends early and the batch
has the same shape), so the only difference is the grammar work. Figure: the unconstrained rows'
time per output token (TPOT, from the engine's per-request timestamps) in B over A, per pair and
the median; the target is <= 1.10. Beside it, the seconds the engine spent in grammar work in each
run (bitmask fill and apply, matcher advance) and their share of the wall time: the overhead
itself, which host noise does not blur. The prefix cache is off so that repeats do equal work.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

# Constraints that never complete, so a companion stays constrained for every one of its tokens.
COMPANION_CONSTRAINTS = [
    {"regex": r'\{"log": \[("[a-z ]{1,12}", )*'},
    {"grammar": 'root ::= "(" expr\nexpr ::= num (("+" | "*") (num | "(" expr))*\nnum ::= [0-9]{1,3}'},
    # A JSON schema whose minItems cannot be met within --tokens.
    {"json": {"type": "array", "minItems": 200, "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 8}}, "required": ["id", "name"]}}},
]
SUBJECTS = ["the sea", "a red fox", "Paris", "prime numbers", "the moon", "bread", "a violin", "winter"]


def run(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t, outputs


def tpot(outputs) -> float:
    """Mean seconds per output token after the first, over ``outputs``."""
    per = []
    for o in outputs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        per.append((m.finished_time - m.first_token_time) / max(n - 1, 1))
    return statistics.mean(per)


def time_grammar_work(engine) -> list[float]:
    """Accumulate the seconds spent in grammar work (bitmask fill + apply, matcher advance) into [0]."""
    total = [0.0]

    def timed(fn):
        def wrapper(*args):
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                total[0] += time.perf_counter() - t
        return wrapper

    masker = engine.structured_output.masker
    masker.apply = timed(masker.apply)
    engine._advance_grammar = timed(engine._advance_grammar)
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--unconstrained", type=int, default=24)
    ap.add_argument("--companions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from engine_service import LLM, SamplingParams

    llm = LLM(dtype=args.dtype, max_model_len=512, kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    u, c, t = args.unconstrained, args.companions, args.tokens
    prompts = [f"Write about {SUBJECTS[i % 8]}, part {i}:" for i in range(u + c)]
    plain = [SamplingParams(temperature=0.0, max_tokens=t, ignore_eos=True) for _ in range(u)]
    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=t, min_tokens=t, ignore_eos=True) for i in range(c)]
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=t, min_tokens=t, ignore_eos=True,
                                  structured_outputs=COMPANION_CONSTRAINTS[i % len(COMPANION_CONSTRAINTS)])
                   for i in range(c)]
    # Warm-up: kernels, the structured-output tokenizer index, the grammars' compilation.
    run(llm, prompts[:4], plain[:2] + constrained[:2])
    grammar_s = time_grammar_work(llm.llm_engine)

    print(f"{u} unconstrained + {c} companions, {t} tokens each, {args.dtype}, torch threads "
          f"{torch.get_num_threads()}")
    print("| pair | run | wall s | unconstrained TPOT ms | companions finished at tokens | grammar work s (share) |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for r in range(args.repeats):
        results = {}
        for name, companions in (("A unconstrained companions", free), ("B constrained companions", constrained)):
            grammar_s[0] = 0.0
            wall, outputs = run(llm, prompts, plain + companions)
            lengths = sorted({len(o.outputs[0].token_ids) for o in outputs[u:]})
            results[name] = tpot(outputs[:u])
            print(f"| {r + 1} | {name} | {wall:.2f} | {results[name] * 1e3:.2f} | {lengths} | "
                  f"{grammar_s[0]:.3f} ({100 * grammar_s[0] / wall:.2f}%) |", flush=True)
        ratios.append(results["B constrained companions"] / results["A unconstrained companions"])
    print(f"\nunconstrained TPOT, B / A per pair: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f} (target <= 1.10)")


if __name__ == "__main__":
    main()
