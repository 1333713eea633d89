"""Serving benchmark: Poisson arrivals through the router, side by side with calling the engine directly.

    python bench/serve.py                                   # rates 1,2,4 req/s, 60 requests each
    python bench/serve.py --rates 0.5,1,2,4,8 --requests 100 --out bench/serve_results
    python bench/serve.py --tiny --rates 5,10,20 --requests 300   # router overhead, small engine time

Starts a private redis-server, ``--engines`` engine processes (bundled model) and one router as
subprocesses (as in production), then for each rate sends ``--requests`` requests with Poisson
arrivals. Every arrival is assigned at random to one of two paths, in the same stream: through the
router (``Router.Generate``) or straight to an engine (``Engine.Generate``, the baseline). Both
paths therefore see the same engine load at the same moments, and their difference is what the
router adds (validation, Redis enqueue + admission, one more gRPC hop). Prompts are random token
ids (distinct per request, so no prefix-cache hits), greedy with ``ignore_eos`` for fixed output
lengths.

``--tiny`` serves a 2-layer random-weight Llama (the bundled tokenizer) instead of the bundled
model: the engine's step time, and so its noise, shrinks to a few milliseconds, which is what it
takes to see a router overhead of about a millisecond on a shared CPU host. What the router does
per request does not depend on the model.

Reports per rate and path: request throughput, output tokens/s, TTFT / TPOT / ITL p50 and p99,
queue time (router: Redis wait + engine queue; direct: engine queue), and the router's added TTFT
p50 (router p50 - direct p50 at that rate). Writes ``<out>.json`` and ``<out>.png`` (latency
against offered load; matplotlib, a dev dependency).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from router.stack import colocated_engine_env, free_port  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


def wait_serving(target: str, procs, timeout: float = 600) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            sys.exit("a benchmark process exited early")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.25)
    sys.exit(f"{target} did not become SERVING")


async def one(path: str, stubs, rng_prompt: list[int], max_tokens: int, request_id: str, record: list) -> None:
    from pagoda.v1 import common_pb2, engine_pb2, router_pb2

    sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    times, tokens, queue = [], 0, float("nan")
    if path == "router":
        call = stubs["router"].Generate(router_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=router_pb2.PromptTokenIds(ids=rng_prompt), sampling=sampling))
        async for m in call:
            if m.token_ids:
                times.append(time.perf_counter())
                tokens += len(m.token_ids)
            if m.finished:
                queue = m.timings.queue_time_s
    else:
        stub = random.choice(stubs["engines"])
        call = stub.Generate(engine_pb2.EngineGenerateRequest(
            request_id=request_id, prompt_token_ids=engine_pb2.TokenIds(ids=rng_prompt), sampling_params=sampling))
        async for m in call:
            n = sum(len(c.token_ids) for c in m.chunks)
            if n:
                times.append(time.perf_counter())
                tokens += n
            if m.finished:
                queue = m.timings.queue_time_s
    end = time.perf_counter()
    record.append({"path": path, "start": t0, "end": end, "ttft": times[0] - t0, "tokens": tokens, "queue": queue,
                   "tpot": (end - times[0]) / max(1, tokens - 1),
                   "itl": [b - a for a, b in zip(times, times[1:])]})


async def run_rate(stubs, rate: float, n: int, args, seed: int) -> dict:
    rng = random.Random(seed)
    records: list[dict] = []
    tasks = []
    t_start = time.perf_counter()
    for i in range(n):
        prompt = [rng.randint(100, 49000) for _ in range(rng.randint(args.min_prompt, args.max_prompt))]
        path = "router" if rng.random() < 0.5 else "direct"
        tasks.append(asyncio.create_task(one(path, stubs, prompt, args.max_tokens, f"r{rate}-{i}", records)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t_start
    out = {"rate": rate, "elapsed_s": elapsed}
    for path in ("router", "direct"):
        rs = [r for r in records if r["path"] == path]
        span = max(r["end"] for r in rs) - min(r["start"] for r in rs)
        itl = [x for r in rs for x in r["itl"]]
        out[path] = {
            "requests": len(rs), "requests_per_s": len(rs) / span, "output_tokens_per_s": sum(r["tokens"] for r in rs) / span,
            **{f"{k}_p{q}_ms": 1e3 * pct([r[k] for r in rs], q / 100) for k in ("ttft", "tpot", "queue") for q in (50, 99)},
            "itl_p50_ms": 1e3 * pct(itl, 0.5), "itl_p99_ms": 1e3 * pct(itl, 0.99)}
    out["router_added_ttft_p50_ms"] = out["router"]["ttft_p50_ms"] - out["direct"]["ttft_p50_ms"]
    return out


async def bench(args, router_target: str, engine_targets: list[str]) -> list[dict]:
    import grpc

    from pagoda.v1 import engine_pb2_grpc, router_pb2_grpc

    channels = [grpc.aio.insecure_channel(t) for t in [router_target, *engine_targets]]
    stubs = {"router": router_pb2_grpc.RouterStub(channels[0]),
             "engines": [engine_pb2_grpc.EngineStub(c) for c in channels[1:]]}
    # Warm both paths (first-call allocations, connections) outside the measured runs.
    await run_rate(stubs, 4.0, 8, args, seed=999)
    results = []
    for k, rate in enumerate(args.rates):
        r = await run_rate(stubs, rate, args.requests, args, seed=k)
        results.append(r)
        print(f"rate {rate:g} req/s: TTFT p50 router {r['router']['ttft_p50_ms']:.1f} ms vs direct "
              f"{r['direct']['ttft_p50_ms']:.1f} ms (router adds {r['router_added_ttft_p50_ms']:+.1f} ms); "
              f"router queue p50 {r['router']['queue_p50_ms']:.1f} ms", flush=True)
    for c in channels:
        await c.close()
    return results


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (metric, label) in zip(axes, [("ttft", "TTFT"), ("tpot", "TPOT"), ("queue", "queue time")]):
        for p, style in (("router", "-o"), ("direct", "--s")):
            for q in (50, 99):
                ax.plot(rates, [r[p][f"{metric}_p{q}_ms"] for r in results], style, alpha=1.0 if q == 50 else 0.5,
                        label=f"{p} p{q}")
        ax.set_xlabel("offered load (requests/s, Poisson)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Pagoda: through the router vs straight to the engine (same arrival stream)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def make_tiny_model(path: Path) -> str:
    """A 2-layer random-weight Llama with the bundled tokenizer (as tests/conftest.py builds)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine_service.model_loader import resolve_model_dir

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    bundled = resolve_model_dir("bundled")
    for name in os.listdir(bundled):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(os.path.join(bundled, name), path / name)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", default="1,2,4", help="offered loads, requests/s")
    ap.add_argument("--requests", type=int, default=60, help="requests per rate (both paths together)")
    ap.add_argument("--engines", type=int, default=1)
    ap.add_argument("--min-prompt", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer random-weight model: measures router overhead")
    ap.add_argument("--out", default=str(ROOT / "bench" / "serve_results"), help="output path without extension")
    args = ap.parse_args()
    args.rates = [float(x) for x in args.rates.split(",")]
    if shutil.which("redis-server") is None:
        sys.exit("redis-server not found on PATH (apt-get install redis-server)")
    workdir = tempfile.mkdtemp(prefix="pagoda-bench-")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("terminated"))  # run the cleanup below
    model = make_tiny_model(Path(workdir) / "tiny") if args.tiny else "bundled"
    redis_port, router_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    procs = []
    quiet = ["--log-level", "WARNING"]
    engine_targets = []
    try:
        procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL))
        for i in range(args.engines):
            port = free_port()
            engine_targets.append(f"127.0.0.1:{port}")
            procs.append(subprocess.Popen([sys.executable, "-m", "engine_service", "serve", "--host", "127.0.0.1",
                                           "--port", str(port), "--metrics-port", str(free_port()), "--model", model,
                                           "--dtype",
                                           args.dtype, "--max-model-len", "1024", "--redis-url", redis_url,
                                           "--engine-id", f"e{i}", *quiet], cwd=ROOT, env=colocated_engine_env()))
        router_target = f"127.0.0.1:{router_port}"
        procs.append(subprocess.Popen([sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port",
                                       str(router_port), "--metrics-port", "-1", "--redis-url", redis_url, *quiet],
                                      cwd=ROOT))
        wait_serving(router_target, procs)
        results = asyncio.run(bench(args, router_target, engine_targets))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(workdir, ignore_errors=True)
    report = {"config": {**vars(args), "cpus": os.cpu_count()}, "results": results}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    try:
        plot(results, out.with_suffix(".png"))
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[dev]'): no plot", file=sys.stderr)
    print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    print("| rate req/s | path | req/s | out tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | ITL p50 / p99 ms | queue p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        for p in ("router", "direct"):
            m = r[p]
            print(f"| {r['rate']:g} | {p} | {m['requests_per_s']:.2f} | {m['output_tokens_per_s']:.1f} | "
                  f"{m['ttft_p50_ms']:.1f} / {m['ttft_p99_ms']:.1f} | {m['tpot_p50_ms']:.1f} / {m['tpot_p99_ms']:.1f} | "
                  f"{m['itl_p50_ms']:.1f} / {m['itl_p99_ms']:.1f} | {m['queue_p50_ms']:.1f} / {m['queue_p99_ms']:.1f} |")
        print(f"|  | router adds to TTFT p50 | | | **{r['router_added_ttft_p50_ms']:+.2f} ms** | | | |")


if __name__ == "__main__":
    main()
