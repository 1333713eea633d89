"""Router behaviour against one small engine process (a 2-layer random-weight Llama, mutual TLS
between router and engine): fairness and aging, backpressure, deadlines, auth, TLS, size limits,
engine client errors, and a Redis outage (last: it restarts Redis). Routers run in this process
(white-box checks) on their own event loop threads."""
from __future__ import annotations

import dataclasses
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import grpc
import pytest

import router.server
from router.client import RouterClient, build_request
from router.config import RouterConfig
from tests.fleet import RedisServer, RouterThread, start_engine, wait_engines, wait_for

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("openssl") is None,
                                reason="needs redis-server and openssl binaries")
CODES = grpc.StatusCode


def make_certs(d: Path) -> dict[str, str]:
    """A private CA, a server certificate for 127.0.0.1/localhost and a client certificate."""
    def run(*args):
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=pagoda-test-ca")
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    for name in ("server", "client"):
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=pagoda-test-{name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "2", "-extfile", "san.ext")
    return {name: str(d / name) for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


@pytest.fixture(scope="module")
def svc(tmp_path_factory, tiny_llama_dir):
    d = tmp_path_factory.mktemp("svc")
    certs = make_certs(d)
    redis_server = RedisServer(d)
    # One sequence at a time: the engine is saturated by a single request, so order is observable.
    engine = start_engine("t1", tiny_llama_dir, redis_server.url, d, "--max-num-seqs", "1",
                          "--tls-cert", certs["server.pem"], "--tls-key", certs["server.key"],
                          "--tls-client-ca", certs["ca.pem"])
    try:
        wait_engines(redis_server.client(), {"t1"}, [engine])
        yield {"redis": redis_server, "engine": engine, "certs": certs, "dir": d}
    finally:
        engine.stop()
        redis_server.stop()


def router_config(svc, **overrides) -> RouterConfig:
    c = svc["certs"]
    options = dict(redis_url=svc["redis"].url, host="127.0.0.1", port=0, engine_tls_ca=c["ca.pem"],
                   engine_tls_cert=c["client.pem"], engine_tls_key=c["client.key"], lease_ttl_s=2.0,
                   shutdown_grace_s=2.0)
    options.update(overrides)
    return RouterConfig(**options)


@pytest.fixture
def make_router(svc):
    routers = []

    def make(**overrides) -> RouterThread:
        rt = RouterThread(router_config(svc, **overrides))
        routers.append(rt)
        wait_for(lambda: rt.server.models and rt.server.engines, 30, "router sees the engine")
        return rt
    yield make
    for rt in routers:
        rt.close()


def model_ns(rt: RouterThread) -> str:
    return f"pagoda:q:{next(iter(rt.server.models))}"


def timed(client: RouterClient, request, results: dict, key, **kw):
    t0 = time.monotonic()
    try:
        out = list(client.stream_request(request, **kw))
        results[key] = (t0, time.monotonic(), out)
    except grpc.RpcError as e:
        results[key] = (t0, time.monotonic(), e)


def test_priority_stream_cannot_starve_a_low_priority_request_beyond_the_aging_bound(make_router):
    boost = 1.0
    rt = make_router(max_queue_wait_boost_s=boost, priority_step_s=1.0, engine_max_waiting=0)
    client = RouterClient(rt.target)
    work = dict(max_tokens=40, ignore_eos=True, temperature=0.0)
    # One request's service time on the saturated engine (max_num_seqs 1).
    t0 = time.monotonic()
    for _ in range(2):
        client.generate([5, 6, 7], **work)
    service = (time.monotonic() - t0) / 2
    feed_s = boost + 10 * service
    results, stop = {}, threading.Event()

    def feeder(k):  # two closed-loop clients of priority 10: one runs, one always waits
        i = 0
        while not stop.is_set():
            timed(client, build_request([8, 9, 10 + k], priority=10, request_id=f"hi-{k}-{i}", **work), results,
                  f"hi-{k}-{i}")
            i += 1

    feeders = [threading.Thread(target=feeder, args=(k,)) for k in range(2)]
    for f in feeders:
        f.start()
    time.sleep(2 * service)  # the stream is steady before the low-priority request arrives
    low = threading.Thread(target=timed, args=(client, build_request([11, 12], priority=0, request_id="low", **work),
                                               results, "low"))
    low.start()
    low.join(feed_s + 30)
    time.sleep(max(0.0, feed_s - (time.monotonic() - t0)))
    stop.set()
    for f in feeders:
        f.join(60)
    client.close()
    start, end, out = results["low"]
    assert not isinstance(out, Exception), out
    wait = out[-1].timings.queue_time_s
    # Bound: the aging bound, plus the request running when it arrived, plus the one that arrived just
    # before the bound (each one service time); slack for a loaded host.
    assert wait <= boost + 2 * service + 0.5, (wait, service)
    # ... and the high-priority stream really went on past it: without aging it would have waited for all.
    later = [v for k, v in results.items() if k.startswith("hi-") and v[0] > start + boost + service]
    assert later and min(v[1] for v in later) > end, "priority-10 requests kept arriving and ran after it"


def test_fcfs_among_equal_priorities_and_deadline_while_queued(make_router):
    # The deadline check at enqueue is off here (it would refuse "late" at once, see the next test).
    rt = make_router(engine_max_waiting=0, slo_min_samples=1_000_000)
    client = RouterClient(rt.target, max_retries=0)
    db = rt.server.redis
    ns = model_ns(rt)
    results = {}
    # The engine must stay busy past late's 0.3 s deadline on any host: one blocker of 250 tiny-model
    # tokens once finished so early on a fast host that late was served instead of expiring, and so
    # did two of 1000 tokens (the model's positions allow 1024) once sampling ran in one C++ pass
    # (~0.3 s each on a 2-core Zen 5, 0.6 s before). Four, the last three queued ahead of the fifo
    # requests, keep it busy ~1 s after late's arrival there.
    blockers = [threading.Thread(target=timed, args=(client, build_request([3, 4], max_tokens=1000, ignore_eos=True),
                                                     results, f"blocker-{i}")) for i in range(4)]
    blockers[0].start()
    wait_for(lambda: rt.server.metrics.requests_running._value.get() >= 1, 30, "blocker running")
    for b in blockers[1:]:
        b.start()
        time.sleep(0.02)  # queued in this order
    time.sleep(0.05)
    threads = []
    for i in range(5):
        t = threading.Thread(target=timed, args=(client, build_request([20 + i], request_id=f"fifo-{i}", max_tokens=3),
                                                 results, f"fifo-{i}"))
        t.start()
        threads.append(t)
        time.sleep(0.05)
    # A request whose deadline passes while it waits behind them: DEADLINE_EXCEEDED, and it leaves the queue.
    timed(client, build_request([30], request_id="late", max_tokens=3), results, "late", timeout=0.3)
    for t in threads + blockers:
        t.join(60)
    client.close()
    start, end, error = results["late"]
    assert isinstance(error, grpc.RpcError) and error.code() == CODES.DEADLINE_EXCEEDED
    assert "queued" in error.details() and end - start < 2.0
    finish_order = sorted((results[f"fifo-{i}"][1], i) for i in range(5))
    assert [i for _, i in finish_order] == list(range(5)), "equal priorities must be served first come, first served"
    assert rt.call(db.zcard(f"{ns}:queue")) == 0 and not rt.call(db.hexists(f"{ns}:payload", "late"))
    assert rt.server.metrics.expired._value.get() == 1


def test_queue_full_and_unmeetable_deadline_are_refused_at_once(make_router):
    small = make_router(max_queue_size=3, engine_max_waiting=0)
    slo = make_router(slo_window_s=10.0, slo_min_samples=4, engine_max_waiting=0)
    client = RouterClient(small.target, max_retries=0)
    for i in range(5):  # recent admissions: the fleet's service rate
        client.generate([40 + i], max_tokens=30, ignore_eos=True)
    results = {}
    threads = [threading.Thread(target=timed, args=(client, build_request([50 + i], max_tokens=200, ignore_eos=True),
                                                    results, i)) for i in range(4)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    queue_key = f"{model_ns(small)}:queue"
    wait_for(lambda: small.call(small.server.redis.zcard(queue_key)) == 3, 30, "three requests waiting")
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as full:
        client.generate([60], max_tokens=2)
    assert full.value.code() == CODES.RESOURCE_EXHAUSTED and "max_queue_size=3" in full.value.details()
    assert time.monotonic() - start < 1.0
    # Three ahead at the rate the router measured: a deadline of half that estimate is refused at once.
    queue = slo.server.queues.get(next(iter(slo.server.models)))
    rate = slo.call(slo.server._admission_rate(queue, next(iter(slo.server.models))))
    assert rate is not None and rate > 0
    deadline = 0.5 * 3 / rate
    with RouterClient(slo.target, max_retries=0) as slo_client:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as refused:
            slo_client.generate([61], max_tokens=2, timeout=deadline)
        assert refused.value.code() == CODES.RESOURCE_EXHAUSTED, refused.value
        assert "deadline cannot be met" in refused.value.details() and time.monotonic() - start < deadline
        assert slo.server.metrics.rejected.labels("RESOURCE_EXHAUSTED")._value.get() == 1
    for t in threads:
        t.join(60)
    assert all(not isinstance(results[i][2], Exception) for i in range(4))
    assert small.call(small.server.redis.zcard(queue_key)) == 0
    client.close()


def test_bearer_token_auth_refuses_before_the_queue(make_router, svc):
    rt = make_router(auth_tokens=("s3cret-token", "other-token"))
    seq_key = f"{model_ns(rt)}:seq"
    before = int(rt.call(rt.server.redis.get(seq_key)) or 0)
    for token, code in ((None, CODES.UNAUTHENTICATED), ("wrong", CODES.PERMISSION_DENIED)):
        with RouterClient(rt.target, token=token, max_retries=0) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate([5, 6], max_tokens=2)
            assert info.value.code() == code
            with pytest.raises(grpc.RpcError) as info:
                client.list_models()
            assert info.value.code() == code
    with RouterClient(rt.target, max_retries=0) as client:
        with pytest.raises(grpc.RpcError) as info:
            list(client.stream([5], max_tokens=2, metadata=[("authorization", "Basic abc")]))
        assert info.value.code() == CODES.UNAUTHENTICATED
    assert int(rt.call(rt.server.redis.get(seq_key)) or 0) == before, "a refused call must not reach the queue"
    with RouterClient(rt.target, token="other-token") as client:
        assert client.generate([5, 6], max_tokens=2).usage.completion_tokens == 2
    logs = svc["engine"].log_path.read_text()
    assert "s3cret-token" not in logs and "other-token" not in logs


def test_tls_on_the_public_api_and_mutual_tls_to_the_engine(make_router, svc):
    c = svc["certs"]
    rt = make_router(tls_cert=c["server.pem"], tls_key=c["server.key"], tls_client_ca=c["ca.pem"])
    read = lambda name: Path(c[name]).read_bytes()  # noqa: E731
    with RouterClient(rt.target, root_certificates=read("ca.pem"), private_key=read("client.key"),
                      certificate_chain=read("client.pem")) as client:
        assert client.generate([7, 8], max_tokens=3).usage.completion_tokens == 3
    for kwargs in ({}, {"root_certificates": read("ca.pem")}):  # plaintext, or TLS without a client certificate
        with RouterClient(rt.target, max_retries=0, **kwargs) as client:
            with pytest.raises(grpc.RpcError) as info:
                client.generate([7, 8], max_tokens=3, timeout=5)
            assert info.value.code() == CODES.UNAVAILABLE
    # The engine refuses a router without a client certificate.
    from pagoda.v1 import engine_pb2, engine_pb2_grpc
    channel = grpc.secure_channel(svc["engine"].target, grpc.ssl_channel_credentials(read("ca.pem")))
    with pytest.raises(grpc.RpcError):
        engine_pb2_grpc.EngineStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
    channel.close()


def test_engine_writes_its_stacks_on_sigusr1_and_keeps_serving(make_router, svc):
    engine = svc["engine"]
    engine.proc.send_signal(signal.SIGUSR1)
    log = lambda: engine.log_path.read_text(errors="replace")  # noqa: E731
    wait_for(lambda: "most recent call first" in log(), 10, "the engine's thread stacks in its log")
    # Then the asyncio tasks, with the await each is parked on: the heartbeat loop's among them.
    wait_for(lambda: "end of task dump" in log(), 10, "the engine's asyncio task stacks in its log")
    tasks = log().split("pending tasks", 1)[1].split("end of task dump", 1)[0]
    assert "registry.py" in tasks and "in _run" in tasks, tasks[:2000]
    assert engine.alive()
    rt = make_router()
    with RouterClient(rt.target, max_retries=0) as client:
        assert client.generate([5, 6], max_tokens=2).usage.completion_tokens == 2


def test_oversized_request_is_refused_not_buffered(make_router):
    rt = make_router(max_request_bytes=64 << 10)
    with RouterClient(rt.target, max_retries=0) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("x " * 100_000, max_tokens=2)
        assert info.value.code() == CODES.RESOURCE_EXHAUSTED
        assert client.generate([5], max_tokens=2).usage.completion_tokens == 2


def test_invalid_argument_from_an_engine_is_relayed_and_not_held_against_it(make_router, monkeypatch):
    rt = make_router()
    real = router.server.validate

    def stale_limits(request, tokenizer, model, limits, request_id):
        # As if this router's view of the engine's limits were looser than the engine's own.
        return real(request, tokenizer, dataclasses.replace(model, max_logprobs=10_000), limits, request_id)

    monkeypatch.setattr(router.server, "validate", stale_limits)
    with RouterClient(rt.target, max_retries=0) as client:
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as info:
                client.generate([5, 6], max_tokens=2, logprobs=5000)
            assert info.value.code() == CODES.INVALID_ARGUMENT and "max_logprobs" in info.value.details()
        start = time.monotonic()
        assert client.generate([5, 6], max_tokens=2).usage.completion_tokens == 2
        assert time.monotonic() - start < rt.server.config.engine_fault_backoff_s
    assert not rt.server._suspect_until and not rt.server._fleet_suspects
    assert rt.server.metrics.engine_faults.labels("t1")._value.get() == 0
    assert not rt.call(rt.server.redis.hgetall("pagoda:engine_suspect"))


def test_redis_outage_gives_unavailable_then_recovers(make_router, svc):
    rt = make_router(redis_outage_grace_s=1.0)
    client = RouterClient(rt.target, max_retries=0)
    assert client.generate([5], max_tokens=2).usage.completion_tokens == 2
    svc["redis"].stop()
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as info:
        client.generate([5], max_tokens=2, timeout=20)
    assert info.value.code() == CODES.UNAVAILABLE and "Redis" in info.value.details()
    assert time.monotonic() - start < 6.0, "an outage must fail fast, not hang"
    wait_for(lambda: not rt.server.redis_up, 10, "router notices the outage")
    with pytest.raises(grpc.RpcError) as info:
        client.generate([5], max_tokens=2, timeout=20)
    assert info.value.code() == CODES.UNAVAILABLE
    svc["redis"].start()  # same port, empty: the engine heartbeats again, the router reconnects
    wait_for(lambda: rt.server.redis_up and rt.server.engines, 20, "router back with the engine")
    with RouterClient(rt.target) as retrying:  # the SDK's safe retries cover the reconnect
        assert retrying.generate([5], max_tokens=2, timeout=30).usage.completion_tokens == 2
    client.close()
