"""Test helpers: a private redis-server, engine and router subprocesses on free loopback ports,
their JSON logs, and an in-process router on its own event loop thread."""
from __future__ import annotations

import asyncio
import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import redis

from router.stack import free_port

ROOT = Path(__file__).resolve().parents[1]
# Small engines: the tests check behaviour, not speed. One torch thread each, so that two engines
# and the test process share the CI machine's two cores without oversubscribing them.
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "64MiB",
               "--heartbeat-interval", "0.1", "--heartbeat-ttl", "1.5"]
CHILD_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(interval)


class RedisServer:
    """A redis-server of our own on a free port (never 6379), no persistence."""

    def __init__(self, workdir: Path, password: str | None = None):
        self.port = free_port()
        self.workdir, self.password = workdir, password
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password)

    def start(self) -> None:
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir)]
        if self.password:
            cmd += ["--requirepass", self.password]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = self.client()

        def up():
            try:
                return client.ping()
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    raise RuntimeError("redis-server exited")
                return False
        wait_for(up, 10, "redis-server start")
        client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Process:
    """A subprocess writing JSON log lines to a file."""

    def __init__(self, name: str, cmd: list[str], log_path: Path, port: int):
        self.name, self.cmd, self.log_path, self.port = name, cmd, log_path, port
        self.log = open(log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=CHILD_ENV, cwd=ROOT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def events(self, event: str | None = None) -> list[dict]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event is None or record.get("event") == event:
                    out.append(record)
        return out

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self, timeout: float = 20) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # Still there: its threads' stacks into its log first (engines and routers dump them on SIGUSR1).
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(0.5)
                self.kill()
        self.log.close()


def start_engine(name: str, model: str, redis_url: str, log_dir: Path, *extra: str) -> Process:
    port = free_port()
    cmd = [sys.executable, "-m", "engine_service", "serve", "--model", model, "--host", "127.0.0.1", "--port",
           str(port), "--metrics-port", str(free_port()), "--redis-url", redis_url, "--engine-id", name, "--shutdown-grace", "2",
           *ENGINE_ARGS, *extra]
    return Process(name, cmd, log_dir / f"{name}.log", port)


def start_router(name: str, redis_url: str, log_dir: Path, *extra: str) -> Process:
    port = free_port()
    cmd = [sys.executable, "-m", "router", "serve", "--host", "127.0.0.1", "--port", str(port), "--metrics-port",
           str(free_port()), "--redis-url", redis_url, "--router-id", name, "--shutdown-grace-s", "2", *extra]
    return Process(name, cmd, log_dir / f"{name}.log", port)


def live_engines(redis_client: redis.Redis, namespace: str = "pagoda") -> set[str]:
    now = float(redis_client.time()[0])
    return {k.decode() for k, v in redis_client.hgetall(f"{namespace}:engine_expiry").items() if float(v) > now}


def wait_engines(redis_client: redis.Redis, names: set[str], processes: list[Process], timeout: float = 240) -> None:
    def ready():
        for p in processes:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited: {p.log_path.read_text()[-3000:]}")
        return names <= live_engines(redis_client)
    wait_for(ready, timeout, f"engines {sorted(names)} registered", interval=0.2)


def wait_serving(process: Process, timeout: float = 60, credentials=None) -> None:
    """Wait until a router's health check says SERVING (it sees Redis and an engine)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    channel = (grpc.secure_channel(process.target, credentials) if credentials is not None
               else grpc.insecure_channel(process.target))
    stub = health_pb2_grpc.HealthStub(channel)

    def serving():
        if not process.alive():
            raise RuntimeError(f"{process.name} exited: {process.log_path.read_text()[-3000:]}")
        try:
            return stub.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False
    try:
        wait_for(serving, timeout, f"{process.name} SERVING", interval=0.1)
    finally:
        channel.close()


class RouterThread:
    """A ``RouterServer`` in this process on its own event loop thread (white-box tests)."""

    def __init__(self, config):
        from router.server import RouterServer

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-router-loop", daemon=True)
        self.thread.start()

        async def make():
            server = RouterServer(config)
            await server.start()
            return server
        self.server = self.call(make())

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def dump_stacks(self) -> None:
        """Every thread's stack and every task of the router's loop, to stderr (a stop that hangs)."""
        faulthandler.dump_traceback(all_threads=True)
        for task in list(asyncio.all_tasks(self.loop)):
            print(f"--- router task {task.get_name()}: {task.get_coro()!r}", file=sys.stderr)
            task.print_stack(file=sys.stderr)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def close(self) -> None:
        try:
            self.call(self.server.shutdown(2.0))
        except TimeoutError:
            self.dump_stacks()
            raise
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
