"""The router fleet end to end: a private redis-server, two engine processes with the bundled model
and two router processes, all on loopback; clients through the SDK. Outputs are compared with the
offline greedy result. The last two tests kill a router, then an engine (so they run last)."""
from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter

import grpc
import pytest

from pagoda.v1 import common_pb2, router_pb2
from router.client import AsyncRouterClient, RouterClient, build_request
from tests.fleet import RedisServer, start_engine, start_router, wait_engines, wait_for, wait_serving

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs a redis-server binary")]

MODEL = "SmolLM2-135M-Instruct"
NS = f"pagoda:q:{MODEL}"
SUBJECTS = ["the sea", "a red fox", "Paris", "prime numbers", "the moon", "a violin"]
TEMPLATES = ["Write one sentence about {}.", "Here is a fact about {}:", "Q: What is {}?\nA:", "{} is"]
PROMPTS = [t.format(s) for t in TEMPLATES for s in SUBJECTS]  # 24
SHORT, LONG = 4, 16  # max_tokens of the load test and of the fault tests


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, bundled_dir):
    logs = tmp_path_factory.mktemp("fleet")
    redis_server = RedisServer(logs)
    procs = []
    try:
        engines = [start_engine(name, "bundled", redis_server.url, logs, "--max-num-seqs", "8") for name in ("e1", "e2")]
        procs += engines
        routers = [start_router(name, redis_server.url, logs, "--lease-ttl-s", "2", "--engine-max-waiting", "2")
                   for name in ("r1", "r2")]
        procs += routers
        client = redis_server.client()
        wait_engines(client, {"e1", "e2"}, engines)
        for r in routers:
            wait_serving(r)
        yield {"redis": redis_server, "db": client, "engines": engines, "routers": routers}
    finally:
        for p in procs:
            p.stop()
        redis_server.stop()


@pytest.fixture(scope="module")
def expected(bundled_dir):
    """Offline greedy outputs of every prompt at both lengths: what the fleet must return."""
    from engine_service import LLM, SamplingParams

    llm = LLM(None, dtype="float32", max_model_len=256, kv_cache_memory_bytes=512 << 20)
    out = {}
    for n in (SHORT, LONG):
        results = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False)
        out[n] = {p: (r.outputs[0].token_ids, r.outputs[0].text) for p, r in zip(PROMPTS, results)}
    out["ids"] = {p: llm.get_tokenizer().encode(p) for p in PROMPTS}
    return out


async def run_clients(targets, jobs, *, timeout=180.0, started: set | None = None):
    """jobs: per client a list of (request_id, prompt, max_tokens); client c uses targets[c % len]. Returns
    request_id -> (token_ids, text, final message) or the RpcError, and the ids that received output
    (``started``, filled as it happens)."""
    results = {}
    started = set() if started is None else started

    async def client(c, work):
        async with AsyncRouterClient(targets[c % len(targets)], max_retries=0) as sdk:
            for request_id, prompt, max_tokens in work:
                ids, text, final = [], "", None
                try:
                    async for delta in sdk.stream(prompt, request_id=request_id, max_tokens=max_tokens,
                                                  temperature=0.0, timeout=timeout):
                        started.add(request_id)
                        ids += delta.token_ids
                        text += delta.text
                        final = delta
                    results[request_id] = (ids, text, final)
                except grpc.RpcError as e:
                    results[request_id] = e

    await asyncio.gather(*(client(c, work) for c, work in enumerate(jobs)))
    return results, started


def engine_finished(fleet) -> Counter:
    """How many times each request id finished on any engine (from the engines' JSON logs)."""
    return Counter(e["request_id"] for p in fleet["engines"] for e in p.events("request.finished"))


def assert_queue_empty(fleet, timeout=10.0):
    db = fleet["db"]
    wait_for(lambda: db.zcard(f"{NS}:queue") == 0 and not db.hlen(f"{NS}:admitted") and not db.hlen(f"{NS}:active")
             and not db.hlen(f"{NS}:payload"), timeout, "queue, admitted table and live ids empty")


def test_300_requests_30_clients_two_routers_two_engines(fleet, expected):
    targets = [r.target for r in fleet["routers"]]
    jobs = []
    for c in range(30):
        work = []
        for k in range(10):
            i = (c * 10 + k) % len(PROMPTS)
            # Every fifth request sends token ids instead of text: the same prompt either way.
            prompt = expected["ids"][PROMPTS[i]] if k % 5 == 4 else PROMPTS[i]
            work.append((f"load-{c}-{k}", prompt, SHORT))
        jobs.append(work)
    t0 = time.monotonic()
    results, _ = asyncio.run(run_clients(targets, jobs))
    elapsed = time.monotonic() - t0
    errors = {rid: r for rid, r in results.items() if isinstance(r, grpc.RpcError)}
    assert not errors, f"{len(errors)} failed, e.g. {next(iter(errors.items()))}"
    assert len(results) == 300
    for c, work in enumerate(jobs):
        for request_id, _, _ in work:
            ids, text, final = results[request_id]
            prompt = PROMPTS[(c * 10 + int(request_id.rsplit("-", 1)[1])) % len(PROMPTS)]
            want_ids, want_text = expected[SHORT][prompt]
            assert ids == want_ids and text == want_text, f"{request_id} ({prompt!r}) differs from offline greedy"
            assert final.finished and final.finish_reason in ("stop", "length") and final.request_id == request_id
            assert final.usage.completion_tokens == len(ids)
            t = final.timings
            assert 0 <= t.queue_time_s <= t.ttft_s <= t.e2e_s
    # Every id ran exactly once on the engines, and both engines took a share.
    finished = engine_finished(fleet)
    load_ids = {rid: n for rid, n in finished.items() if rid.startswith("load-")}
    assert len(load_ids) == 300 and set(load_ids.values()) == {1}
    per_engine = [sum(1 for e in p.events("request.finished") if e["request_id"].startswith("load-"))
                  for p in fleet["engines"]]
    assert min(per_engine) >= 30, per_engine
    assert_queue_empty(fleet)
    print(f"\n300 requests in {elapsed:.1f} s; per engine {per_engine}")


def test_bad_input_is_refused_naming_the_field_and_nothing_is_queued(fleet):
    db = fleet["db"]
    seq_before = int(db.get(f"{NS}:seq") or 0)
    finished_before = sum(engine_finished(fleet).values())
    S = common_pb2.SamplingParams
    too_long = "word " * 400
    cases = [
        (router_pb2.GenerateRequest(), "input"),
        (router_pb2.GenerateRequest(prompt=""), "prompt"),
        (router_pb2.GenerateRequest(prompt=too_long), "max_model_len"),
        (router_pb2.GenerateRequest(prompt_token_ids=router_pb2.PromptTokenIds(ids=[1, 49152])), "prompt_token_ids"),
        (router_pb2.GenerateRequest(prompt_token_ids=router_pb2.PromptTokenIds()), "prompt_token_ids"),
        (router_pb2.GenerateRequest(messages=router_pb2.ChatMessages()), "messages"),
        (router_pb2.GenerateRequest(messages=router_pb2.ChatMessages(
            messages=[router_pb2.ChatMessage(role="wizard", content="hi")])), "messages[0].role"),
        (router_pb2.GenerateRequest(prompt="x", priority=-1), "priority"),
        (router_pb2.GenerateRequest(prompt="x", priority=1000), "priority"),
        (router_pb2.GenerateRequest(prompt="x", request_id="has space"), "request_id"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(temperature=-1)), "sampling.temperature"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(temperature=float("nan"))), "sampling.temperature"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(top_p=0)), "sampling.top_p"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(top_p=1.5)), "sampling.top_p"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(top_k=-2)), "sampling.top_k"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(min_p=2)), "sampling.min_p"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(presence_penalty=3)), "sampling.presence_penalty"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(frequency_penalty=-3)), "sampling.frequency_penalty"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(repetition_penalty=0)), "sampling.repetition_penalty"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=0)), "sampling.max_tokens"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(max_tokens=4, min_tokens=5)), "sampling.min_tokens"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(n=0)), "sampling.n"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(n=100)), "sampling.n"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(logprobs=21)), "sampling.logprobs"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(prompt_logprobs=21)), "sampling.prompt_logprobs"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(stop=[""])), "sampling.stop"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(stop=["s"] * 17)), "sampling.stop"),
        (router_pb2.GenerateRequest(prompt="x", sampling=S(stop_token_ids=[50000])), "sampling.stop_token_ids"),
    ]
    codes = grpc.StatusCode
    with RouterClient(fleet["routers"][0].target, max_retries=0) as client:
        for request, field in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(client.stream_request(request, timeout=30))
            assert info.value.code() == codes.INVALID_ARGUMENT, (field, info.value)
            assert field in info.value.details(), (field, info.value.details())
        with pytest.raises(grpc.RpcError) as info:
            list(client.stream_request(build_request("x", model="no-such-model"), timeout=30))
        assert info.value.code() == codes.NOT_FOUND and MODEL in info.value.details()
        # The refusals did not disturb the fleet: a good request still goes through at once.
        assert client.generate("The capital of France is", max_tokens=2, temperature=0.0, timeout=60).usage.completion_tokens == 2
    assert int(db.get(f"{NS}:seq") or 0) == seq_before + 1, "only the good request may have reached the queue"
    assert sum(engine_finished(fleet).values()) == finished_before + 1


def test_batch_models_health_reflection_and_metrics(fleet, expected):
    import urllib.request

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    router = fleet["routers"][1]
    requests = [build_request(p, max_tokens=SHORT, temperature=0.0) for p in PROMPTS[:6]]
    requests.insert(3, build_request("", max_tokens=SHORT))  # a bad item fails alone
    # logprobs and prompt logprobs are relayed (their values: test_engine_service)
    requests[1] = build_request(PROMPTS[1], max_tokens=SHORT, temperature=0.0, logprobs=1, prompt_logprobs=2)
    with RouterClient(router.target) as client:
        results = list(client.generate_batch(requests, timeout=120))
        models = client.list_models()
        channel = client.channel
        assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="pagoda.v1.Router"),
                                                         timeout=10).status == health_pb2.HealthCheckResponse.SERVING
        services = [s.name for r in reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
            for s in r.list_services_response.service]
    assert sorted(r.index for r in results) == list(range(7))
    for r in results:
        if r.index == 3:
            assert r.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "prompt" in r.error_message
            continue
        prompt = PROMPTS[r.index if r.index < 3 else r.index - 1]
        assert r.error_code == 0 and r.request_id == requests[r.index].request_id
        assert (list(r.completions[0].token_ids), r.completions[0].text) == tuple(expected[SHORT][prompt])
        assert r.usage.completion_tokens == len(r.completions[0].token_ids)
        if r.index == 1:
            ids = expected["ids"][prompt]
            assert [p.sampled.token_id for p in r.prompt_logprobs] == ids[1:]
            assert all([t.rank for t in p.top] == [1, 2] and p.sampled.logprob <= 0 for p in r.prompt_logprobs)
            assert [p.sampled.token_id for p in r.completions[0].logprobs] == list(r.completions[0].token_ids)
            assert all(len(p.top) == 1 for p in r.completions[0].logprobs)
        else:
            assert not r.prompt_logprobs and not r.completions[0].logprobs
    assert [(m.id, m.max_model_len, m.num_engines) for m in models] == [(MODEL, 256, 2)]
    assert {"pagoda.v1.Router", "grpc.health.v1.Health"} <= set(services)
    metrics_port = int(router.cmd[router.cmd.index("--metrics-port") + 1])
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    for name in ("pagoda:router_queue_wait_seconds_bucket{le=", 'pagoda:router_requests_admitted_total',
                 'pagoda:router_requests_rejected_total{code="INVALID_ARGUMENT"}', "pagoda:router_queue_depth",
                 'pagoda:router_engine_free_blocks{engine="e1"}', "pagoda:router_time_to_first_token_seconds_count"):
        assert name in text, name


def test_kill_a_router_mid_load(fleet, expected):
    r1, r2 = fleet["routers"]
    db = fleet["db"]
    # r2's clients fill the queue with long requests; r1's clients run alongside. r2 alone has more
    # clients (28) than the engines have slots (2 x (8 running + 2 waiting)), so at least 8 of its
    # requests wait in the queue whatever the order of admission (with 16 it took all four
    # overflow places only when r1's clients happened to be admitted first).
    doomed = [[(f"doomed-{c}-{k}", PROMPTS[(7 * c + k) % len(PROMPTS)], LONG) for k in range(3)] for c in range(28)]
    kept = [[(f"kept-{c}-{k}", PROMPTS[(5 * c + k) % len(PROMPTS)], SHORT) for k in range(3)] for c in range(8)]

    async def main():
        doomed_task = asyncio.create_task(run_clients([r2.target], doomed))
        kept_task = asyncio.create_task(run_clients([r1.target], kept))

        def r2_queued():
            owners = db.hgetall(f"{NS}:owner")
            queued = {m.decode().split(":", 1)[1] for m in db.zrange(f"{NS}:queue", 0, -1)}
            return sum(1 for rid, owner in owners.items() if owner == b"r2" and rid.decode() in queued) >= 4
        await asyncio.to_thread(wait_for, r2_queued, 60, "r2's requests waiting in the queue")
        r2.kill()
        killed_at = time.monotonic()

        def r2_gone():
            return b"r2" not in db.hgetall(f"{NS}:owner").values()
        await asyncio.to_thread(wait_for, r2_gone, 10, "r2's entries reaped")
        reaped_after = time.monotonic() - killed_at
        kept_results, _ = await kept_task
        doomed_results, _ = await doomed_task
        return reaped_after, kept_results, doomed_results

    reaped_after, kept_results, doomed_results = asyncio.run(main())
    # Lease 2 s, renewed every 1 s by r1, which also reaps: gone within lease + one maintenance round.
    assert reaped_after < 2 + 1 + 1.5, reaped_after
    for work in kept:
        for request_id, prompt, n in work:
            ids, text, final = kept_results[request_id]
            assert (ids, text) == expected[n][prompt] and final.finished
    assert all(isinstance(r, grpc.RpcError) or r[2].finished for r in doomed_results.values())
    # The engines let go of r2's streams (its connections died with it): the fleet drains to empty.
    assert_queue_empty(fleet, timeout=30)
    assert not db.hgetall(f"{NS}:owner")


def test_kill_an_engine_mid_load(fleet, expected):
    r1 = fleet["routers"][0]
    e1, e2 = fleet["engines"]
    db = fleet["db"]
    # 30 clients against 2 x (8 running + 2 waiting) engine slots: some wait in the queue throughout.
    jobs = [[(f"fault-{c}-{k}", PROMPTS[(3 * c + k) % len(PROMPTS)], LONG) for k in range(2)] for c in range(30)]

    async def main():
        seen_output: set[str] = set()
        task = asyncio.create_task(run_clients([r1.target], jobs, timeout=120, started=seen_output))

        def e2_streaming():
            on_e2 = {rid.decode() for rid, e in db.hgetall(f"{NS}:admitted").items() if e == b"e2"}
            return len(on_e2 & seen_output) >= 2 and db.zcard(f"{NS}:queue") >= 1
        await asyncio.to_thread(wait_for, e2_streaming, 60, "streams with output on e2 while others wait")
        e2.kill()
        t0 = time.monotonic()
        results, started = await task
        return results, started, time.monotonic() - t0

    results, started, drained_s = asyncio.run(main())
    unavailable = {rid for rid, r in results.items() if isinstance(r, grpc.RpcError)}
    failed_on_e2 = {e["request_id"] for e in r1.events("request.engine_failed_mid_stream") if e["engine"] == "e2"}
    for rid in unavailable:
        assert results[rid].code() == grpc.StatusCode.UNAVAILABLE, results[rid]
        assert "e2" in results[rid].details() and rid in failed_on_e2, f"{rid} failed but not mid-stream on e2"
        assert rid in started, f"{rid} ended UNAVAILABLE before any output: it should have been re-admitted"
    assert unavailable, "streams that had started on the killed engine should end UNAVAILABLE"
    assert len(unavailable) <= 8 + 2, "at most e2's running and waiting requests can fail"
    for work in jobs:
        for request_id, prompt, n in work:
            if request_id not in unavailable:
                ids, text, final = results[request_id]
                assert (ids, text) == expected[n][prompt] and final.finished, request_id
    # Nothing ran twice: no id finished twice, and none that failed on e2 also finished on e1.
    finished_e1 = Counter(e["request_id"] for e in e1.events("request.finished"))
    assert all(finished_e1[rid] <= 1 for rid in results)
    assert not unavailable & set(finished_e1)
    readmitted = {e["request_id"] for e in r1.events("request.readmitted")}
    assert readmitted <= set(results) - unavailable
    assert_queue_empty(fleet, timeout=30)
    print(f"\nafter the kill: {len(unavailable)} UNAVAILABLE, {len(readmitted)} re-admitted, drained in {drained_s:.1f} s")
