"""Engine service overhead: N concurrent gRPC streams vs the same requests through ``LLM.generate``.

    python bench/serve_engine.py                          # 64 streams, requests of W, bfloat16
    python bench/serve_engine.py --streams 16 --max-tokens 32 --dtype float32

The server runs as a subprocess (``python -m engine_service serve``, its own GIL, as in
production) with the same engine options as the offline ``LLM`` in this process; the two paths
alternate ``--repeats`` times so the host's noise hits both, repeat r on requests r*N..(r+1)*N-1 of
the shared W (../shared/bench/workload.py: greedy, ignore_eos, exact output lengths) so that no
run hits the prefix cache filled by an earlier one. Prints output
tokens/s of both and their ratio (target: gRPC >= 90% of offline at 64 streams), TTFT and
inter-token latency p50/p99 as the clients saw them.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from router.stack import free_port  # noqa: E402
from throughput import load_workload_module  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))] if values else float("nan")


def run_offline(llm, requests) -> dict:
    from engine_service import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return {"elapsed": elapsed, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs), "ttft": ttft, "itl": []}


async def run_grpc(target: str, requests, tag: str) -> dict:
    import grpc

    from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc

    ttft, itl, tokens = [], [], []

    async def one(stub, i: int, r: dict, t0: float) -> None:
        req = engine_pb2.EngineGenerateRequest(
            request_id=f"{tag}-{i}", prompt_token_ids=engine_pb2.TokenIds(ids=r["prompt_token_ids"]),
            sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=True))
        last, n = None, 0
        async for message in stub.Generate(req):
            now = time.perf_counter()
            k = sum(len(c.token_ids) for c in message.chunks)
            if k:
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last, n = now, n + k
        tokens.append(n)

    async with grpc.aio.insecure_channel(target) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(stub, i, r, t0) for i, r in enumerate(requests)))
        elapsed = time.perf_counter() - t0
    return {"elapsed": elapsed, "tokens": sum(tokens), "ttft": ttft, "itl": itl}


async def wait_serving(target: str, process: subprocess.Popen, timeout: float = 600) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    async with grpc.aio.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                sys.exit(f"server exited with {process.returncode}")
            try:
                if (await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)).status == 1:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)
    sys.exit("server did not become SERVING in time")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64, help="concurrent streams = requests per run")
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every request's output length")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    ap.add_argument("--repeats", type=int, default=1, help="alternating offline / gRPC runs")
    args = ap.parse_args()

    workload = load_workload_module().get("W")
    if args.max_tokens:
        workload = [{**r, "max_tokens": min(r["max_tokens"], args.max_tokens)} for r in workload]
    # Each repeat takes the next N requests of W: the same prompts again would hit the prefix cache.
    slices = [[workload[(rep * args.streams + i) % len(workload)] for i in range(args.streams)]
              for rep in range(args.repeats)]
    rng = random.Random(1)
    warm = [{"prompt_token_ids": [rng.randint(100, 49000) for _ in range(64)], "max_tokens": 8} for _ in range(4)]
    options = dict(dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    port = free_port()
    target = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "engine_service", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--metrics-port", str(free_port()), "--log-level", "WARNING",
           *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()]]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=sys.stderr)
    try:
        from engine_service import LLM

        llm = LLM(None, **options)
        asyncio.run(wait_serving(target, server))
        # Warm both paths (first-call allocations, kernel builds) outside the timed runs.
        run_offline(llm, warm)
        asyncio.run(run_grpc(target, warm, "warm"))
        runs = []
        for rep, requests in enumerate(slices):
            runs.append(("offline LLM.generate", rep, requests, run_offline(llm, requests)))
            runs.append(("gRPC streams", rep, requests, asyncio.run(run_grpc(target, requests, f"rep{rep}"))))
    finally:
        server.terminate()
        server.wait(60)

    print(f"\n{args.streams} concurrent streams, requests from W (greedy, ignore_eos), dtype {args.dtype}, "
          f"{os.cpu_count()} CPUs; repeat r runs W[r*{args.streams}:(r+1)*{args.streams}] on both paths")
    print("| repeat | path | prompt / output tokens | output tok/s | elapsed s | TTFT p50 / p99 s | ITL p50 / p99 ms |")
    print("|---|---|---|---|---|---|---|")
    totals: dict[str, list[float]] = {}
    for name, rep, requests, run in runs:
        expected = sum(r["max_tokens"] for r in requests)
        assert run["tokens"] == expected, f"{name}: {run['tokens']} tokens, expected {expected}"
        prompt = sum(len(r["prompt_token_ids"]) for r in requests)
        tokens, elapsed = totals.setdefault(name, [0, 0.0])
        totals[name] = [tokens + run["tokens"], elapsed + run["elapsed"]]
        itl = run["itl"]
        itl_text = f"{1e3 * percentile(itl, 0.5):.0f} / {1e3 * percentile(itl, 0.99):.0f}" if itl else "n/a"
        print(f"| {rep} | {name} | {prompt} / {expected} | {run['tokens'] / run['elapsed']:.1f} | "
              f"{run['elapsed']:.1f} | {percentile(run['ttft'], 0.5):.2f} / {percentile(run['ttft'], 0.99):.2f} | "
              f"{itl_text} |")
    rates = {name: tokens / elapsed for name, (tokens, elapsed) in totals.items()}
    print(f"all repeats: offline {rates['offline LLM.generate']:.1f} tok/s, gRPC {rates['gRPC streams']:.1f} tok/s, "
          f"gRPC / offline {rates['gRPC streams'] / rates['offline LLM.generate']:.1%}")


if __name__ == "__main__":
    main()
