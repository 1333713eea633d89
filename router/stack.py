"""The local stack without Docker (``make run`` / ``python -m router stack``): a redis-server on a
free port, one engine with the bundled model, one router; demo prompts through the router; the
answers and queue/latency figures printed; everything stopped on exit (Ctrl-C included)."""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEMO_PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is", "def fibonacci(n):",
                "Three facts about the moon:", "A haiku about autumn:"]
DEMO_CHAT = [{"role": "user", "content": "What is the capital of France?"}]
REDIS_MISSING = """redis-server was not found on PATH. The local stack starts its own Redis; install it with
    Debian/Ubuntu:  sudo apt-get install redis-server
    macOS:          brew install redis
    Fedora:         sudo dnf install redis
or run the Docker stack instead: docker compose up"""


_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port nobody listens on, never handed out twice by this process, and outside the
    kernel's ephemeral range. A port from bind(0) is in that range, where an outgoing connection (a
    Redis or gRPC client) can take it before the child process that was given it binds it, seconds
    later once its model has loaded (seen in the test fleet and in the stack: 'already in use')."""
    lo, hi = _ephemeral_range()
    pool = (20000, lo) if lo - 20000 >= 2000 else (hi + 1, 65536)
    for _ in range(1000):
        port = random.randrange(*pool)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {pool}")


def colocated_engine_env() -> dict[str, str]:
    """The environment for an engine process that shares its cores with a router, Redis and clients:
    OpenMP threads that sleep at once when idle (``OMP_WAIT_POLICY=PASSIVE``) instead of spinning for
    the next parallel region. With spinning threads, a router or client waiting for a core queues
    behind them: on the 2-core dev host, with another process busy, the engine's own TTFT p50 was
    133-152 ms spinning against 6 ms passive (bench/RESULTS.md). Alone on its cores, spinning is
    ~10% faster (offline W: 677-723 vs 609-615 tok/s), so only co-located engines get this; an
    ``OMP_WAIT_POLICY`` already set wins."""
    return {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}


def _wait_redis(port: int, proc: subprocess.Popen, timeout: float = 15) -> None:
    import redis

    client = redis.Redis(port=port)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)


def _wait_serving(target: str, procs: list[subprocess.Popen], timeout: float = 600) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = grpc.insecure_channel(target)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    last_note = 0.0
    while True:
        for p in procs:
            if p.poll() is not None:
                raise SystemExit(f"a stack process exited with {p.returncode}; see the logs above")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                channel.close()
                return
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit("the router did not become SERVING in time")
        if time.monotonic() - last_note > 10:
            print("  waiting for the engine to load the model and register ...", flush=True)
            last_note = time.monotonic()
        time.sleep(0.25)


async def _demo(target: str, max_tokens: int) -> None:
    from router.client import AsyncRouterClient

    async with AsyncRouterClient(target) as client:
        models = await client.list_models()
        print(f"\nmodels: {', '.join(f'{m.id} (max_model_len {m.max_model_len}, {m.num_engines} engine)' for m in models)}")
        t0 = time.perf_counter()
        jobs = [client.generate(p, max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=i)
                for i, p in enumerate(DEMO_PROMPTS)]
        jobs.append(client.generate(messages=DEMO_CHAT, max_tokens=max_tokens, temperature=0.0))
        results = await asyncio.gather(*jobs)
        elapsed = time.perf_counter() - t0
    prompts = DEMO_PROMPTS + [f"[chat] {DEMO_CHAT[0]['content']}"]
    for prompt, r in zip(prompts, results):
        t = r.timings
        print(f"\n--- {prompt!r}\n{r.text}\n[finish_reason={r.outputs[0].finish_reason}, "
              f"{r.usage.completion_tokens} tokens, queue {t.queue_time_s * 1e3:.1f} ms, TTFT {t.ttft_s * 1e3:.0f} ms, "
              f"e2e {t.e2e_s * 1e3:.0f} ms]")
    tokens = sum(r.usage.completion_tokens for r in results)
    queue = [r.timings.queue_time_s * 1e3 for r in results]
    ttft = [r.timings.ttft_s * 1e3 for r in results]
    print(f"\n{len(results)} requests through the router in {elapsed:.2f} s: {tokens} tokens ({tokens / elapsed:.1f} tok/s); "
          f"queue time p50 {statistics.median(queue):.1f} ms / max {max(queue):.1f} ms; "
          f"TTFT p50 {statistics.median(ttft):.0f} ms / max {max(ttft):.0f} ms")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> None:
    if shutil.which("redis-server") is None:
        sys.exit(REDIS_MISSING)
    workdir = tempfile.mkdtemp(prefix="pagoda-stack-")
    # The stack talks to these three, so it picks their ports (free_port: outside the ephemeral
    # range). The /metrics endpoints, which it does not read, get port 0 and bind whatever port the
    # OS gives (a metrics port picked by bind(0) was once taken before the engine bound it).
    redis_port, engine_port, router_port = free_port(), free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    target = f"127.0.0.1:{router_port}"
    procs: list[subprocess.Popen] = []
    log_level = ["--log-level", "WARNING"]
    # The children run in sessions of their own, so a Ctrl-C in the terminal reaches this process
    # alone, and SIGTERM / SIGHUP end it as Ctrl-C does: it then stops them in order (below).
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        print(f"redis-server on 127.0.0.1:{redis_port}")
        procs.append(subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", workdir],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        _wait_redis(redis_port, procs[-1])
        print(f"engine ({args.model}, {args.dtype}) on 127.0.0.1:{engine_port}")
        procs.append(subprocess.Popen([sys.executable, "-m", "engine_service", "serve", "--model", args.model,
                                       "--dtype", args.dtype, "--host", "127.0.0.1", "--port", str(engine_port),
                                       "--metrics-port", "0", "--redis-url", redis_url, *log_level],
                                      env=colocated_engine_env(), start_new_session=True))
        print(f"router on {target}")
        procs.append(subprocess.Popen([sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port",
                                       str(router_port), "--metrics-port", "0", "--redis-url",
                                       redis_url, *log_level], start_new_session=True))
        _wait_serving(target, procs)
        asyncio.run(_demo(target, args.max_tokens))
        if args.keep_running:
            print(f"\nserving on {target} (python -m router generate --target {target} \"...\"); Ctrl-C stops",
                  flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        # Router, then engine, then Redis, each gone before the next is asked: the services
        # deregister from Redis on their way out. A second Ctrl-C (or SIGTERM) here is ignored.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        shutil.rmtree(workdir, ignore_errors=True)
        print("stack stopped", flush=True)


if __name__ == "__main__":  # pragma: no cover
    from router.__main__ import build_parser

    main(build_parser().parse_args(["stack", *sys.argv[1:]]))
