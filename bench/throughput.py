"""Offline throughput on the shared workload: Pagoda vs transformers' generate, in one run.

    python bench/throughput.py --dtype bfloat16                    # Pagoda on W, HF baselines
    python bench/throughput.py --dtype float32 --static-workload W-small
    python bench/throughput.py --only pagoda --workload W-small     # quick look

Workload: ../shared/bench/workload.py (W: 256 requests, greedy, ignore_eos, exact output
lengths). Figure of merit: output tokens/s from first submit to last token, model load excluded.
Baselines run in this same process so the ratios are not thrown off by the host's noise:
transformers one prompt at a time (W-small by default: it is slow), and padded static batches of
32 (each batch runs until its longest request is done; only requested tokens are counted).
The torch matmul rate is measured beside them, to show how far from the machine's ceiling we are.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_workload_module():
    candidates = [os.environ.get("PAGODA_WORKLOAD"), ROOT.parent / "shared" / "bench" / "workload.py"]
    for path in candidates:
        if path and Path(path).exists():
            spec = importlib.util.spec_from_file_location("workload", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
    sys.exit("shared workload not found: expected ../shared/bench/workload.py or $PAGODA_WORKLOAD")


def matmul_gflops(dtype: torch.dtype, n: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e9


def model_flops(requests, num_params: int, lm_head_params: int) -> float:
    """2 x non-embedding weights per processed token, + the LM head on each sampled token."""
    prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    output = sum(r["max_tokens"] for r in requests)
    return 2.0 * num_params * (prompt + output) + 2.0 * lm_head_params * output


def run_pagoda(requests, dtype: str, **engine_options) -> dict:
    from engine_service import LLM, SamplingParams

    llm = LLM(dtype=dtype, **engine_options)
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert out_tokens == sum(r["max_tokens"] for r in requests), "every request must produce its exact length"
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
    return {"elapsed": elapsed, "output_tokens": out_tokens, "ttft_p50": ttft[len(ttft) // 2],
            "ttft_p99": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))],
            "preemptions": llm.llm_engine.scheduler.num_preemptions}


def load_hf(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from engine_service.model_loader import resolve_model_dir

    return AutoModelForCausalLM.from_pretrained(resolve_model_dir("bundled"), dtype=dtype).eval()


@torch.inference_mode()
def run_hf_single(model, requests, on_done=None) -> dict:
    """One prompt at a time; ``on_done(requests done, tokens so far, seconds)`` after each."""
    t0 = time.perf_counter()
    total = 0
    for i, r in enumerate(requests):
        ids = torch.tensor([r["prompt_token_ids"]])
        m = r["max_tokens"]
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m, min_new_tokens=m,
                             do_sample=False, pad_token_id=0)
        total += out.shape[1] - ids.shape[1]
        if on_done:
            on_done(i + 1, total, time.perf_counter() - t0)
    return {"elapsed": time.perf_counter() - t0, "output_tokens": total}


@torch.inference_mode()
def run_hf_static(model, requests, batch_size: int = 32) -> dict:
    t0 = time.perf_counter()
    total = 0
    for i in range(0, len(requests), batch_size):
        batch = requests[i:i + batch_size]
        longest = max(len(r["prompt_token_ids"]) for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding
            p = r["prompt_token_ids"]
            ids[row, longest - len(p):] = torch.tensor(p)
            mask[row, longest - len(p):] = 1
        m = max(r["max_tokens"] for r in batch)
        model.generate(ids.to(model.device), attention_mask=mask.to(model.device), max_new_tokens=m,
                       min_new_tokens=m, do_sample=False, pad_token_id=0)
        total += sum(r["max_tokens"] for r in batch)
    return {"elapsed": time.perf_counter() - t0, "output_tokens": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="W", choices=["W", "W-small"])
    ap.add_argument("--single-workload", default="W-small", choices=["W", "W-small"])
    ap.add_argument("--static-workload", default="W", choices=["W", "W-small"])
    ap.add_argument("--only", default="pagoda,hf-single,hf-static",
                    help="comma-separated subset of pagoda,hf-single,hf-static")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    args = ap.parse_args()
    which = set(args.only.split(","))
    workload = load_workload_module()
    tdtype = getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype}")
    gflops = matmul_gflops(tdtype)
    print(f"matmul 2048^3 {args.dtype}: {gflops:.0f} GFLOP/s")

    print("\n| engine | workload | output tok/s | total tok/s | elapsed s | notes |")
    print("|---|---|---|---|---|---|", flush=True)
    rates = {}

    def report(name: str, wl: str, reqs, res: dict) -> None:
        """Print a row as soon as it is measured (a long baseline must not hide the others)."""
        out_rate = res["output_tokens"] / res["elapsed"]
        prompt = sum(len(r["prompt_token_ids"]) for r in reqs)
        total_rate = (res["output_tokens"] + prompt) / res["elapsed"]
        rates[name] = out_rate
        notes = ""
        if "ttft_p50" in res:
            notes = (f"TTFT p50 {res['ttft_p50']:.1f} s, p99 {res['ttft_p99']:.1f} s; "
                     f"{res['preemptions']} preemptions; {100 * res['ceiling']:.0f}% of the 2048^3 matmul rate")
        print(f"| {name} | {wl} | {out_rate:.1f} | {total_rate:.1f} | {res['elapsed']:.1f} | {notes} |", flush=True)

    if "pagoda" in which:
        reqs = workload.get(args.workload)
        res = run_pagoda(reqs, args.dtype, max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens)
        from engine_service.model_loader import load_config, resolve_model_dir
        cfg = load_config(resolve_model_dir("bundled"))
        lm_head = cfg.vocab_size * cfg.hidden_size
        layers = cfg.num_hidden_layers * (
            cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
            + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size)
        res["ceiling"] = model_flops(reqs, layers, lm_head) / res["elapsed"] / 1e9 / gflops
        report("pagoda", args.workload, reqs, res)
    model = load_hf(tdtype) if which & {"hf-single", "hf-static"} else None
    if "hf-single" in which:
        reqs = workload.get(args.single_workload)
        report("transformers one-at-a-time", args.single_workload, reqs, run_hf_single(model, reqs))
    if "hf-static" in which:
        reqs = workload.get(args.static_workload)
        report("transformers static batch 32", args.static_workload, reqs, run_hf_static(model, reqs))
    if "pagoda" in rates:
        for name, rate in rates.items():
            if name != "pagoda":
                print(f"pagoda / {name}: {rates['pagoda'] / rate:.2f}x")


if __name__ == "__main__":
    main()
