"""Batch-job throughput against plain ``LLM.generate`` on the same rows, in one process.

    python bench/batch_job.py                      # 256 rows, 32 output tokens each
    python bench/batch_job.py --rows 512 --tokens 64 --repeats 2

The rows are OpenAI batch chat rows (half) and completions rows (half), every one generating exactly
``--tokens`` tokens (``ignore_eos``), greedy. Runs, alternated ``--repeats`` times on one engine
with the prefix cache off (so that repeats do equal work):
- ``LLM.generate``: the prompts (chat rows through the chat template) and SamplingParams in one call;
- batch job: ``run_job`` over the JSONL file with the in-process backend, writing results.jsonl
  (parsing, templating, one flushed write per row and the progress bar included).
Figure: output tokens/s of each, and the job's over ``LLM.generate`` (the job's overhead; target ~1.0).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

SUBJECTS = ["the sea", "a red fox", "Paris", "prime numbers", "the moon", "bread", "a violin", "winter"]


def make_rows(n: int, tokens: int) -> list[dict]:
    rows = []
    for i in range(n):
        body = {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        if i % 2:
            body["messages"] = [{"role": "user", "content": f"Tell me about {SUBJECTS[i % 8]} (question {i})."}]
            rows.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        else:
            body["prompt"] = f"Question {i}: what do you know about {SUBJECTS[i % 8]}? Answer:"
            rows.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    from engine_service import LLM, SamplingParams
    from engine_service.batch import run_job
    from engine_service.batch_backends import LocalBackend

    llm = LLM(dtype=args.dtype, max_model_len=512, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False)
    rows = make_rows(args.rows, args.tokens)
    workdir = tempfile.mkdtemp(prefix="pagoda-batch-bench-")
    src = os.path.join(workdir, "requests.jsonl")
    with open(src, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    prompts = [{"prompt_token_ids": llm.apply_chat_template(r["body"]["messages"])} if "messages" in r["body"]
               else r["body"]["prompt"] for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    total_tokens = args.rows * args.tokens

    print(f"{args.rows} rows x {args.tokens} output tokens, {args.dtype}, max_num_seqs "
          f"{llm.llm_engine.config.max_num_seqs}")
    print("| repeat | path | wall s | output tok/s |")
    print("|---|---|---|---|")
    ratios = []
    for r in range(args.repeats):
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - t
        assert sum(len(o.outputs[0].token_ids) for o in outputs) == total_tokens
        print(f"| {r + 1} | LLM.generate | {generate_s:.2f} | {total_tokens / generate_s:.1f} |", flush=True)

        out = os.path.join(workdir, f"results-{r}.jsonl")
        t = time.perf_counter()
        summary = run_job(src, out, LocalBackend(llm.llm_engine), progress=False)
        job_s = time.perf_counter() - t
        assert summary.rows_ok == args.rows and summary.completion_tokens == total_tokens, summary
        print(f"| {r + 1} | batch job (in process) | {job_s:.2f} | {total_tokens / job_s:.1f} |", flush=True)
        ratios.append(generate_s / job_s)
    print(f"\nbatch job / LLM.generate throughput: {', '.join(f'{x:.3f}' for x in ratios)}; "
          f"median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
