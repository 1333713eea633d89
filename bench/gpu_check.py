"""The engine on a CUDA GPU: greedy identity with transformers, and throughput on the shared workload.

    python bench/gpu_check.py model DIR --like HF_DIR      # SmolLM2-135M's shape, random weights
    python bench/gpu_check.py identity DIR [--dtype float32 bfloat16]
    python bench/gpu_check.py throughput DIR [--dtype bfloat16] [--profile-out FILE]
    python bench/gpu_check.py steps DIR [--budgets 2048 8192] [--out-dir DIR]

bench/gpu_check.sh runs them all on a lent GPU machine, where the bundled GGUF cannot travel (it is
larger than what a call carries): ``model`` writes a random-weight model with SmolLM2-135M's config
and tokenizer (copied from ``--like``, the converted bundled directory). Weights are drawn wider
than the default initializer so greedy decoding has few near-ties; the cost of a step does not
depend on their values.

identity: 8 token-id prompts of 5-1000 tokens, 48 greedy tokens each, on Pagoda (``device="cuda"``,
Triton attention) in four set-ups: all together; chunked at a 64-token step budget (chunks mixed
with decodes); and a KV pool of 150 blocks that forces preemption, by recompute and by swap. The
reference is transformers' own greedy decoding on the same GPU, one prompt at a time. At a
sequence's first differing token the reference's float32 logits give the margin between its token
and Pagoda's: a margin far above the dtype's rounding is a bug, one near it is a near-tie.

throughput: the shared workload W (256 requests, greedy, ``ignore_eos``) through Pagoda's step loop
(bench/engine_runner.py's ``drive``), then transformers' ``generate`` on the same GPU in padded static
batches of 32 and of 256, all in one process. Then a torch.profiler window of 20 Pagoda decode-heavy
steps: host time per step against the GPU's busy time shows whether the step is launch-bound.

steps: each step's wall time on W at each prefill budget, and a cProfile of the last budget's run.
bench/RESULTS.md ("The engine on a GPU") has what these gave on an H200.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_device_memory(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def make_model(out_dir: str, like: str, std: float, layers: int | None) -> None:
    from transformers import AutoConfig, LlamaForCausalLM

    config = AutoConfig.from_pretrained(like)
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, std)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in os.listdir(like):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(os.path.join(like, name), os.path.join(out_dir, name))
    print(json.dumps({"model": out_dir, "layers": config.num_hidden_layers, "std": std,
                      "params": sum(p.numel() for p in model.parameters())}))


def identity_prompts() -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randint(100, 49000) for _ in range(n)] for n in (5, 17, 64, 129, 300, 511, 777, 1000)]


SETUPS = {
    "together": {},
    "chunked-64": {"max_num_batched_tokens": 64},
    "preempt-recompute": {"num_gpu_blocks_override": 150, "max_model_len": 1100},
    "preempt-swap": {"num_gpu_blocks_override": 150, "max_model_len": 1100, "preemption_mode": "swap"},
}


def identity_setup(model_dir, device, dtype, name, opts, prompts, ref, max_new) -> dict:
    from engine_service import LLM, SamplingParams

    llm = LLM(model_dir, device=device, dtype=dtype, kv_cache_memory_bytes=2 << 30, **opts)
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    diverged = []
    for i, ((want, logits), have) in enumerate(zip(ref, got)):
        if have == want:
            continue
        t = next(j for j, (a, b) in enumerate(zip(want, have)) if a != b)
        lg = logits[t]
        diverged.append({"prompt": i, "len": len(prompts[i]), "step": t,
                         "margin": round(float(lg[want[t]] - lg[have[t]]), 5), "logit_std": round(float(lg.std()), 3)})
    return {"dtype": dtype, "setup": name, "identical": f"{len(prompts) - len(diverged)}/{len(prompts)}",
            "preemptions": llm.llm_engine.scheduler.num_preemptions, "attention": llm.llm_engine.runner.attn.name,
            "diverged": diverged, "tokens": got}


def identity(model_dir: str, dtypes: list[str], device: str, max_new: int) -> int:
    from transformers import AutoModelForCausalLM

    from tests.hf_reference import hf_greedy_with_logits

    prompts = identity_prompts()
    bad = 0
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(device).eval()
        t0 = time.perf_counter()
        ref = [hf_greedy_with_logits(hf, p, max_new) for p in prompts]
        print(json.dumps({"dtype": dtype, "hf_attention": hf.config._attn_implementation,
                          "hf_seconds": round(time.perf_counter() - t0, 2)}), flush=True)
        del hf
        first = None
        for name, opts in SETUPS.items():
            try:
                row = identity_setup(model_dir, device, dtype, name, opts, prompts, ref, max_new)
            except Exception as e:  # report and go on: the other set-ups still tell something
                print(json.dumps({"dtype": dtype, "setup": name, "error": repr(e)[:500]}), flush=True)
                bad += len(prompts)
                continue
            tokens = row.pop("tokens")
            first = tokens if first is None else first
            row["same_as_together"] = sum(a == b for a, b in zip(tokens, first))
            print(json.dumps(row), flush=True)
            if dtype == "float32":
                bad += len(row["diverged"])
            bad += len(prompts) - row["same_as_together"]  # batching must not change greedy tokens
            free_device_memory(device)
    return 1 if bad else 0


def throughput(model_dir: str, dtype: str, device: str, workload: str, profile_out: str | None,
               hf_batches: list[int]) -> None:
    from engine_runner import load_workload
    from throughput import run_hf_static
    from transformers import AutoModelForCausalLM

    requests = load_workload(workload)
    out_tokens = sum(r["max_tokens"] for r in requests)
    prompt_tokens = sum(len(r["prompt_token_ids"]) for r in requests)
    rows = []
    for label, opts in (("pagoda", {}), ("pagoda budget 8192", {"max_num_batched_tokens": 8192})):
        try:
            res = pagoda_throughput(model_dir, device, dtype, requests, label, opts,
                                    profile_out if label == "pagoda" else None)
        except Exception as e:  # report and go on to the baselines
            print(json.dumps({"engine": label, "error": repr(e)[:500]}), flush=True)
            continue
        rows.append(res)
        print(json.dumps(res), flush=True)
        free_device_memory(device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    run_hf_static(hf, requests[:2], 2)  # warm-up (generate syncs every step: its timings hold on a GPU)
    for bs in hf_batches:
        res = run_hf_static(hf, requests, bs)
        res["engine"] = f"transformers static batches of {bs} ({hf.config._attn_implementation})"
        rows.append(res)
        print(json.dumps(res), flush=True)
    base = rows[0]["output_tokens"] / rows[0]["elapsed"]  # the first row: Pagoda's defaults, if it ran
    print(f"\nW: {len(requests)} requests, {prompt_tokens} prompt + {out_tokens} output tokens, {dtype}, "
          f"{torch.cuda.get_device_name() if device == 'cuda' else device}")
    print(f"{'engine':58s} {'out tok/s':>10s} {'total tok/s':>11s} {'vs pagoda':>9s}")
    for r in rows:
        tps = r["output_tokens"] / r["elapsed"]
        print(f"{r['engine']:58s} {tps:10.1f} {(prompt_tokens + out_tokens) / r['elapsed']:11.1f} "
              f"{tps / base:9.3f}")


def pagoda_throughput(model_dir, device, dtype, requests, label, opts, profile_out) -> dict:
    from engine_runner import drive, pagoda_adder, warm_up_pagoda

    from engine_service import LLM

    t0 = time.perf_counter()
    llm = LLM(model_dir, device=device, dtype=dtype, **opts)
    engine = llm.llm_engine
    load_s = time.perf_counter() - t0
    warm_up_pagoda(engine, requests)
    res = drive(engine, pagoda_adder(engine), requests)
    res.update(engine=label, load_s=round(load_s, 1), kv_blocks=engine.config.num_kv_blocks,
               block_size=engine.config.block_size, preemptions=engine.scheduler.num_preemptions,
               ms_per_step=round(1e3 * res["elapsed"] / res["steps"], 2))
    if profile_out:
        try:
            profile_steps(engine, requests, profile_out, device)
        except Exception as e:
            print(json.dumps({"profile_error": repr(e)[:500]}), flush=True)
    return res


def profile_steps(engine, requests, path: str, device: str, steps: int = 20) -> None:
    """Host time per step against the GPU's busy time, over ``steps`` steps of a fresh W-small run
    once its prompts are in (decode-heavy steps, the steady state)."""
    from engine_runner import pagoda_adder

    add = pagoda_adder(engine)
    for r in requests[:64]:
        add({**r, "id": f"prof-{r['id']}"})
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    # Kernels only: an op's row repeats its kernels' device time.
    gpu_us = sum(e.self_device_time_total for e in events
                 if e.device_type == torch.autograd.DeviceType.CUDA) if device == "cuda" else 0.0
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunchKernel", "cuLaunchKernel")))
    summary = {"profiled_steps": steps, "running": len(engine.scheduler.running),
               "wall_ms_per_step": round(1e3 * wall / steps, 2),
               "gpu_busy_ms_per_step": round(gpu_us / 1e3 / steps, 2),
               "kernel_launches_per_step": round(launches / steps, 1)}
    print(json.dumps(summary), flush=True)
    with open(path, "w") as f:
        f.write(json.dumps(summary) + "\n\n")
        if device == "cuda":
            try:
                f.write(events.table(sort_by="self_device_time_total", row_limit=30) + "\n\n")
            except Exception:
                f.write(events.table(sort_by="self_cuda_time_total", row_limit=30) + "\n\n")
        f.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
    while engine.has_unfinished_requests():
        engine.step()


def step_times(model_dir: str, dtype: str, device: str, workload: str, budgets: list[int], out_dir: str) -> None:
    """Each step's wall time on W at each prefill budget (first steps and the decode tail), then a
    cProfile of the largest budget's run: where a GPU step's host time goes."""
    import cProfile
    import pstats

    from engine_runner import load_workload, pagoda_adder, warm_up_pagoda

    from engine_service import LLM

    requests = load_workload(workload)
    for budget in budgets:
        llm = LLM(model_dir, device=device, dtype=dtype, max_num_batched_tokens=budget)
        engine = llm.llm_engine
        warm_up_pagoda(engine, requests)
        add = pagoda_adder(engine)
        prof = cProfile.Profile() if budget == budgets[-1] else None
        for r in requests:
            add(r)
        times = []
        t_all = time.perf_counter()
        if prof:
            prof.enable()
        while engine.has_unfinished_requests():
            t0 = time.perf_counter()
            engine.step()
            times.append(1e3 * (time.perf_counter() - t0))
        if prof:
            prof.disable()
        total = time.perf_counter() - t_all
        print(json.dumps({"budget": budget, "profiled": bool(prof), "steps": len(times), "total_s": round(total, 2),
                          "first_12_ms": [round(t, 1) for t in times[:12]],
                          "median_ms": round(sorted(times)[len(times) // 2], 2),
                          "last_12_ms": [round(t, 1) for t in times[-12:]]}), flush=True)
        if prof:
            path = os.path.join(out_dir, f"cprofile_budget{budget}.txt")
            with open(path, "w") as f:
                st = pstats.Stats(prof, stream=f)
                st.sort_stats("tottime").print_stats(35)
                st.sort_stats("cumulative").print_stats(35)
            st = pstats.Stats(prof)
            st.sort_stats("tottime").print_stats(15)
        del llm, engine, add  # add holds the engine: its KV pool must go before the next one
        free_device_memory(device)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("model")
    m.add_argument("dir")
    m.add_argument("--like", required=True, help="a HF directory whose config and tokenizer to copy")
    m.add_argument("--std", type=float, default=0.05)
    m.add_argument("--layers", type=int, default=None, help="fewer layers (a quick run of this script on CPU)")
    i = sub.add_parser("identity")
    i.add_argument("dir")
    i.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    i.add_argument("--max-new", type=int, default=48)
    t = sub.add_parser("throughput")
    t.add_argument("dir")
    t.add_argument("--dtype", default="bfloat16")
    t.add_argument("--workload", default="W", choices=["W", "W-small"])
    t.add_argument("--hf-batches", type=int, nargs="*", default=[32, 256])
    t.add_argument("--profile-out", default=None)
    st = sub.add_parser("steps")
    st.add_argument("dir")
    st.add_argument("--dtype", default="bfloat16")
    st.add_argument("--workload", default="W", choices=["W", "W-small"])
    st.add_argument("--budgets", type=int, nargs="+", default=[2048, 8192])
    st.add_argument("--out-dir", default=".")
    for p in (i, t, st):
        p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.cmd == "model":
        make_model(args.dir, args.like, args.std, args.layers)
        return 0
    if args.cmd == "identity":
        return identity(args.dir, args.dtype, args.device, args.max_new)
    if args.cmd == "steps":
        step_times(args.dir, args.dtype, args.device, args.workload, args.budgets, args.out_dir)
        return 0
    throughput(args.dir, args.dtype, args.device, args.workload, args.profile_out, args.hf_batches)
    return 0


if __name__ == "__main__":
    sys.exit(main())
