"""The engine gRPC service end to end: a real server on loopback (its own event loop thread, as in
production), real grpc.aio clients, outputs compared with the offline ``LLM.generate``."""
from __future__ import annotations

import asyncio
import re
import threading
import time
import urllib.request

import grpc
import pytest
import torch

from engine_service import LLM, EngineConfig, SamplingParams
from engine_service import async_engine
from engine_service.async_engine import AsyncEngine, StreamOverrun
from engine_service.server import EngineServer
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagoda.v1 import common_pb2, engine_pb2, engine_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CODES = grpc.StatusCode
BUNDLED_OPTIONS = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
TINY_OPTIONS = dict(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20)


class ServerThread:
    """An ``EngineServer`` on its own event loop thread; tests drive clients from another loop."""

    def __init__(self, config: EngineConfig, **options):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-server-loop", daemon=True)
        self.thread.start()
        self.server: EngineServer = self.call(self._start(config, options))

    async def _start(self, config, options) -> EngineServer:
        server = EngineServer(config, host="127.0.0.1", port=0, **options)
        await server.start()
        return server

    def call(self, coro, timeout: float = 300):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self) -> "ServerThread":
        self.call(self.server.wait_ready())
        return self

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def slow_down_steps(self, seconds: float) -> None:
        """Make every engine step take at least ``seconds``, so streams stay in flight long enough."""
        engine = self.server.engine.engine
        step = engine.step

        def slow_step():
            time.sleep(seconds)
            return step()

        engine.step = slow_step

    def close(self, grace_s: float = 5.0) -> None:
        self.call(self.server.shutdown(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()


class Stream:
    """What a client received on one Generate stream."""

    def __init__(self):
        self.text = ""
        self.token_ids: list[int] = []
        self.messages: list[engine_pb2.EngineGenerateResponse] = []
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED

    def add(self, message: engine_pb2.EngineGenerateResponse) -> None:
        self.messages.append(message)
        for chunk in message.chunks:
            self.text += chunk.text
            self.token_ids += chunk.token_ids
            if chunk.finish_reason:
                self.finish_reason = chunk.finish_reason

    @property
    def final(self) -> engine_pb2.EngineGenerateResponse:
        return self.messages[-1]


def request(request_id: str, prompt: str | list[int], **params) -> engine_pb2.EngineGenerateRequest:
    prompt_field = {"text": prompt} if isinstance(prompt, str) else {"prompt_token_ids": engine_pb2.TokenIds(ids=prompt)}
    return engine_pb2.EngineGenerateRequest(request_id=request_id, sampling_params=common_pb2.SamplingParams(**params),
                                      **prompt_field)


async def generate(stub, req: engine_pb2.EngineGenerateRequest, timeout: float | None = None) -> Stream:
    stream = Stream()
    async for message in stub.Generate(req, timeout=timeout):
        stream.add(message)
    return stream


async def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last value {value!r})")
        await asyncio.sleep(interval)


async def idle_load(stub) -> common_pb2.EngineLoad:
    """Wait for the engine to be idle: all KV blocks free, nothing running or waiting."""
    async def idle():
        load = await stub.GetLoad(engine_pb2.GetLoadRequest())
        free = load.num_free_blocks == load.num_total_blocks
        return load if free and not load.num_running_requests and not load.num_waiting_requests else None

    return await wait_until(idle, timeout=15)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(pagoda:\S+) (\S+)$", text, re.M)}


def metric(samples: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


# ---- the bundled model: equality with offline generation, cancellation ------------------------

@pytest.fixture(scope="module")
def bundled_server(bundled_dir):
    st = ServerThread(EngineConfig(model=None, **BUNDLED_OPTIONS), metrics_port=0).wait_ready()
    yield st
    st.close()


@pytest.fixture(scope="module")
def offline(bundled_dir) -> LLM:
    return LLM(None, **BUNDLED_OPTIONS)


SUBJECTS = ["the sea", "a red fox", "Paris", "prime numbers", "the moon", "bread", "a violin", "winter"]
TEMPLATES = ["Write one sentence about {}.", "Here is a fact about {}:", "Q: What is {}?\nA:",
             "My favourite thing about {} is", "{} is", "Describe {} in three words:", "Once upon a time, {}",
             "The history of {} began"]
PROMPTS = [t.format(s) for t in TEMPLATES for s in SUBJECTS]  # 64


@pytest.mark.slow
def test_64_concurrent_greedy_streams_equal_offline_generate(bundled_server, offline):
    ignore_eos = [i % 2 == 0 for i in range(len(PROMPTS))]  # odd ones may stop at EOS
    expected = offline.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=e)
                                          for e in ignore_eos], use_tqdm=False)
    before = scrape(bundled_server.server.metrics_port)

    async def main():
        async with grpc.aio.insecure_channel(bundled_server.target) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            return await asyncio.gather(*(
                generate(stub, request(f"eq-{i}", p, temperature=0.0, max_tokens=16, ignore_eos=e))
                for i, (p, e) in enumerate(zip(PROMPTS, ignore_eos))))

    streams = asyncio.run(main())
    for i, (got, want) in enumerate(zip(streams, expected)):
        c = want.outputs[0]
        assert got.token_ids == c.token_ids, f"stream {i} ({PROMPTS[i]!r}): token ids differ from LLM.generate"
        assert got.text == c.text, f"stream {i} ({PROMPTS[i]!r}): text differs from LLM.generate"
        assert common_pb2.FinishReason.Name(got.finish_reason) == f"FINISH_REASON_{c.finish_reason.upper()}"
        assert got.final.finished and all(not m.finished for m in got.messages[:-1])
        assert got.final.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.final.usage.completion_tokens == len(c.token_ids)
        t = got.final.timings
        assert 0 <= t.queue_time_s <= t.ttft_s <= t.e2e_s
    # Tokens stream as they are produced, not in one piece at the end.
    assert max(len(s.messages) for s in streams) >= 8

    after = scrape(bundled_server.server.metrics_port)
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    total_tokens = sum(len(s.token_ids) for s in streams)
    assert delta("pagoda:time_to_first_token_seconds_count") == 64
    assert delta("pagoda:e2e_request_latency_seconds_count") == 64
    assert delta("pagoda:inter_token_latency_seconds_count") == total_tokens - 64
    assert delta("pagoda:generation_tokens_total") == total_tokens
    assert delta("pagoda:prompt_tokens_total") == sum(len(o.prompt_token_ids) for o in expected)
    assert delta("pagoda:request_success_total", finish_reason="length") == sum(ignore_eos) + sum(
        s.finish_reason == common_pb2.FINISH_REASON_LENGTH for s, e in zip(streams, ignore_eos) if not e)
    assert delta("pagoda:prefix_cache_queries_total") >= delta("pagoda:prompt_tokens_total")
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
                  "prefix_cache_hits_total"):
        assert f"pagoda:{gauge}" in {k.partition("{")[0] for k in after}


@pytest.mark.slow
def test_logit_bias_allowed_token_ids_bad_words_and_truncation_over_grpc_as_offline(bundled_server, offline):
    """logit_bias, allowed_token_ids and bad_words in common.proto's SamplingParams reach the
    engine's sampler: the same tokens as LLM.generate with the same parameters, and not the
    unbiased ones;
    truncate_prompt_tokens runs an over-long prompt on its last tokens."""
    prompt = PROMPTS[0]
    plain = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    bias = {plain[0]: -100.0, plain[1]: -100.0}
    allowed = [plain[2], 28, 30, 1000]
    word = offline.get_tokenizer().decode(plain[:2])  # the plain output's first two tokens, as a bad word
    cases = [dict(logit_bias=bias), dict(allowed_token_ids=allowed), dict(bad_words=[word])]
    expected = [offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **c),
                                 use_tqdm=False)[0].outputs[0].token_ids for c in cases]
    # truncate_prompt_tokens rides in the same SamplingParams: a prompt past max_model_len runs on its tail.
    tail = offline.get_tokenizer().encode(prompt)
    long_prompt = [28] * 1100 + tail
    cases.append(dict(truncate_prompt_tokens=len(tail)))
    expected.append(offline.generate({"prompt_token_ids": tail}, SamplingParams(temperature=0.0, max_tokens=6,
                                                                                ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0].token_ids)

    async def main():
        async with grpc.aio.insecure_channel(bundled_server.target) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            return await asyncio.gather(*(
                generate(stub, request(f"bias-{i}", long_prompt if "truncate_prompt_tokens" in c else prompt,
                                       temperature=0.0, max_tokens=6, ignore_eos=True, **c))
                for i, c in enumerate(cases)))

    biased, only, no_word, truncated = asyncio.run(main())
    assert truncated.token_ids == expected[3] and truncated.final.usage.prompt_tokens == len(tail)
    assert biased.token_ids == expected[0] and not {plain[0], plain[1]} & set(biased.token_ids)
    assert only.token_ids == expected[1] and set(only.token_ids) <= set(allowed) and only.token_ids != plain
    assert no_word.token_ids == expected[2] and no_word.token_ids[:2] != plain[:2]


@pytest.mark.slow
def test_logprobs_and_prompt_logprobs_stream_as_offline_generate_gives_them(bundled_server, offline):
    """Each position's token, logprob and rank and its top `logprobs` (exactly that many, by rank;
    the sampled token's own entry beside them when it is not among them), and the prompt tokens'
    `prompt_logprobs` on the stream's first message only: what LLM.generate returns, field for field."""
    prompts, k, kp = PROMPTS[:4], 3, 2
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k, prompt_logprobs=kp)
    expected = offline.generate(prompts, params, use_tqdm=False)

    async def main():
        async with grpc.aio.insecure_channel(bundled_server.target) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            return await asyncio.gather(*(
                generate(stub, request(f"lp-{i}", p, temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=k,
                                       prompt_logprobs=kp))
                for i, p in enumerate(prompts)))

    def same(position: common_pb2.PositionLogprobs, token: int, entry: dict, top: int):
        assert position.sampled.token_id == token
        assert position.sampled.logprob == pytest.approx(entry[token].logprob, abs=1e-6)
        assert position.sampled.rank == entry[token].rank
        assert position.sampled.token == entry[token].decoded_token and entry[token].decoded_token
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank)[:top]
        assert [(t.token_id, t.rank, t.token) for t in position.top] == \
            [(tid, lp.rank, lp.decoded_token) for tid, lp in ranked]
        assert [t.rank for t in position.top] == list(range(1, top + 1))

    for got, want in zip(asyncio.run(main()), expected):
        c = want.outputs[0]
        assert got.token_ids == c.token_ids
        positions = [lp for m in got.messages for chunk in m.chunks for lp in chunk.logprobs]
        assert len(positions) == len(c.token_ids)
        for position, token, entry in zip(positions, c.token_ids, c.logprobs):
            same(position, token, entry, k)
        first, *rest = got.messages
        assert all(not m.prompt_logprobs for m in rest)
        assert len(first.prompt_logprobs) == len(want.prompt_token_ids) - 1 and want.prompt_logprobs[0] is None
        for position, token, entry in zip(first.prompt_logprobs, want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
            same(position, token, entry, kp)


@pytest.mark.slow
def test_cancel_half_of_32_streams_frees_their_blocks(bundled_server, offline):
    prompts = PROMPTS[:32]
    keep = [i % 2 == 0 for i in range(32)]
    # Cancelled streams ask for up to max_model_len: if cancelling did not abort them, the engine
    # would stay busy far longer than idle_load() waits.
    expected = offline.generate([p for p, k in zip(prompts, keep) if k],
                                SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    before = scrape(bundled_server.server.metrics_port)

    async def main():
        async with grpc.aio.insecure_channel(bundled_server.target) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            seen_busy = []

            async def run(i: int, prompt: str) -> Stream:
                stream = Stream()
                call = stub.Generate(request(f"cancel-{i}", prompt, temperature=0.0, ignore_eos=True,
                                             max_tokens=24 if keep[i] else 500))
                async for message in call:
                    stream.add(message)
                    if not keep[i] and len(stream.token_ids) >= 4:
                        if i == 1:
                            seen_busy.append(await stub.GetLoad(engine_pb2.GetLoadRequest()))
                        call.cancel()
                        break
                return stream

            # One more stream ended by the Abort RPC: it finishes with FINISH_REASON_ABORT.
            async def aborted() -> Stream:
                stream = Stream()
                async for message in stub.Generate(request("abort-me", "Tell me a long story.", temperature=0.0,
                                                           ignore_eos=True, max_tokens=500)):
                    stream.add(message)
                    if len(stream.messages) == 2:
                        assert (await stub.Abort(engine_pb2.AbortRequest(request_id="abort-me"))).found
                return stream

            # And one whose deadline passes: that aborts it too.
            async def deadline() -> grpc.StatusCode:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generate(stub, request("deadline", "Count to a thousand.", ignore_eos=True, max_tokens=500),
                                   timeout=1.0)
                return info.value.code()

            streams = await asyncio.gather(*(run(i, p) for i, p in enumerate(prompts)), aborted(), deadline())
            assert not (await stub.Abort(engine_pb2.AbortRequest(request_id="no-such-request"))).found
            load = await idle_load(stub)
            return streams, seen_busy, load

    streams, seen_busy, load = asyncio.run(main())
    *streams, aborted, deadline_code = streams
    assert deadline_code == CODES.DEADLINE_EXCEEDED
    kept = [s for s, k in zip(streams, keep) if k]
    for got, want in zip(kept, expected):
        assert got.token_ids == want.outputs[0].token_ids and got.text == want.outputs[0].text
        assert got.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert all(4 <= len(s.token_ids) < 500 for s, k in zip(streams, keep) if not k)
    assert aborted.finish_reason == common_pb2.FINISH_REASON_ABORT and aborted.final.finished
    assert seen_busy and seen_busy[0].num_running_requests > 0
    assert seen_busy[0].num_free_blocks < seen_busy[0].num_total_blocks
    assert load.num_free_blocks == load.num_total_blocks > 0
    after = scrape(bundled_server.server.metrics_port)
    aborts = metric(after, "pagoda:request_success_total", finish_reason="abort") - metric(
        before, "pagoda:request_success_total", finish_reason="abort")
    assert aborts == 18, "every cancelled stream, the Abort RPC and the deadline should abort their engine requests"


@pytest.mark.slow
def test_health_reflection_and_model_info(bundled_server):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    async def main():
        async with grpc.aio.insecure_channel(bundled_server.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "pagoda.v1.Engine"):
                assert (await health.Check(health_pb2.HealthCheckRequest(service=service))).status == SERVING
            info = await engine_pb2_grpc.EngineStub(channel).ModelInfo(engine_pb2.ModelInfoRequest())
            refl = reflection_pb2_grpc.ServerReflectionStub(channel)
            services = []
            async for r in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                services += [s.name for s in r.list_services_response.service]
            return info, services

    info, services = asyncio.run(main())
    assert info.model_id == "SmolLM2-135M-Instruct" and info.model == "bundled"
    assert info.max_model_len == 512 and info.vocab_size == 49152 and 2 in info.eos_token_ids
    assert info.dtype == "float32" and info.block_size == 64 and info.tokenizer
    assert {"pagoda.v1.Engine", "grpc.health.v1.Health"} <= set(services)


# ---- a tiny random-weight model: refusals, overload, health, shutdown, slow readers ----------

def test_bad_input_and_overload_are_refused_while_others_stream(tiny_llama_dir):
    st = ServerThread(EngineConfig(model=tiny_llama_dir, max_num_seqs=3, **TINY_OPTIONS),
                      max_waiting_requests=1).wait_ready()
    st.slow_down_steps(0.005)
    offline = LLM(tiny_llama_dir, **TINY_OPTIONS)
    long_prompts = [[100 + 7 * i + j for j in range(5 + i)] for i in range(4)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in offline.generate(
        [{"prompt_token_ids": p} for p in long_prompts], SamplingParams(max_tokens=64, **greedy), use_tqdm=False)]
    short = offline.generate("A short one.", SamplingParams(max_tokens=12, **greedy), use_tqdm=False)[0].outputs[0]

    bad = {  # request -> (status code, words the message must contain)
        "empty": (request("b0", ""), CODES.INVALID_ARGUMENT, "prompt"),
        "no prompt": (engine_pb2.EngineGenerateRequest(request_id="b1"), CODES.INVALID_ARGUMENT, "prompt"),
        "too long": (request("b2", [5] * 1024), CODES.INVALID_ARGUMENT, "max_model_len"),
        "vocab": (request("b3", [5, 49152]), CODES.INVALID_ARGUMENT, "prompt_token_ids"),
        "temperature": (request("b4", "x", temperature=-1.0), CODES.INVALID_ARGUMENT, "temperature"),
        "top_p": (request("b5", "x", top_p=0.0), CODES.INVALID_ARGUMENT, "top_p"),
        "top_k": (request("b6", "x", top_k=-3), CODES.INVALID_ARGUMENT, "top_k"),
        "min_p": (request("b7", "x", min_p=1.5), CODES.INVALID_ARGUMENT, "min_p"),
        "presence_penalty": (request("b8", "x", presence_penalty=3.0), CODES.INVALID_ARGUMENT, "presence_penalty"),
        "frequency_penalty": (request("b9", "x", frequency_penalty=-3.0), CODES.INVALID_ARGUMENT,
                              "frequency_penalty"),
        "repetition_penalty": (request("b10", "x", repetition_penalty=0.0), CODES.INVALID_ARGUMENT,
                               "repetition_penalty"),
        "n": (request("b11", "x", n=0), CODES.INVALID_ARGUMENT, "SamplingParams.n "),
        "max_tokens": (request("b12", "x", max_tokens=0), CODES.INVALID_ARGUMENT, "max_tokens"),
        "min_tokens": (request("b13", "x", max_tokens=4, min_tokens=5), CODES.INVALID_ARGUMENT, "min_tokens"),
        "stop_token_ids": (request("b14", "x", stop_token_ids=[10 ** 6]), CODES.INVALID_ARGUMENT, "stop_token_ids"),
        "stop": (request("b15", "x", stop=[""]), CODES.INVALID_ARGUMENT, "stop"),
        "logit_bias": (request("b16", "x", logit_bias={10 ** 6: 1.0}), CODES.INVALID_ARGUMENT, "logit_bias"),
        "logit_bias value": (request("b17", "x", logit_bias={5: float("nan")}), CODES.INVALID_ARGUMENT, "logit_bias"),
        "allowed_token_ids": (request("b18", "x", allowed_token_ids=[49152]), CODES.INVALID_ARGUMENT,
                              "allowed_token_ids"),
        "bad_words": (request("b19", "x", bad_words=["ok", "  "]), CODES.INVALID_ARGUMENT, "bad_words"),
        "duplicate": (request("long-0", "x"), CODES.ALREADY_EXISTS, "request_id"),
        "overload": (request("over", "x"), CODES.RESOURCE_EXHAUSTED, "max_waiting_requests"),
    }

    async def main():
        async with grpc.aio.insecure_channel(st.target) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            streams = [Stream() for _ in long_prompts]
            calls, readers = [], []

            async def read(call, stream):
                try:
                    async for message in call:
                        stream.add(message)
                except asyncio.CancelledError:
                    pass

            async def load_is(running, waiting):
                load = await stub.GetLoad(engine_pb2.GetLoadRequest())
                return load.num_running_requests == running and load.num_waiting_requests == waiting

            # One at a time: a burst would find the 1-request waiting queue full before any is admitted.
            for i, (p, stream) in enumerate(zip(long_prompts, streams)):
                calls.append(stub.Generate(request(f"long-{i}", p, max_tokens=1000, **greedy)))
                readers.append(asyncio.create_task(read(calls[-1], stream)))
                await wait_until(lambda: load_is(min(i + 1, 3), max(i - 2, 0)))  # max_num_seqs=3, then 1 waiting
            before = [len(s.token_ids) for s in streams[:3]]

            async def refused(req):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await generate(stub, req)
                return info.value

            errors = await asyncio.gather(*(refused(req) for req, _, _ in bad.values()))
            await wait_until(lambda: _async(all(len(s.token_ids) > b + 4 for s, b in zip(streams, before))))
            for call in calls[:2]:
                call.cancel()
            await wait_until(lambda: load_is(2, 0))  # the waiting one took a freed seat
            short_stream = await generate(stub, request("short", "A short one.", max_tokens=12, **greedy))
            for call in calls[2:]:
                call.cancel()
            await asyncio.gather(*readers)
            await idle_load(stub)
            return errors, streams, short_stream

    try:
        errors, streams, short_stream = asyncio.run(main())
    finally:
        st.close()
    for (case, (_, code, words)), error in zip(bad.items(), errors):
        assert error.code() == code, f"{case}: {error.code()} {error.details()!r}"
        assert words in error.details(), f"{case}: the message should name {words!r}: {error.details()!r}"
    for i, (stream, want) in enumerate(zip(streams, expected)):
        n = min(len(stream.token_ids), len(want))
        assert n >= 8 and stream.token_ids[:n] == want[:n], f"in-flight stream {i} diverged from LLM.generate"
    assert short_stream.token_ids == short.token_ids and short_stream.text == short.text


async def _async(value):
    return value


def test_health_follows_loading_stalls_and_graceful_shutdown(tiny_llama_dir, monkeypatch):
    gate = threading.Event()

    class GatedEngine(async_engine.LLMEngine):
        def __init__(self, config):
            assert gate.wait(60)
            super().__init__(config)

    monkeypatch.setattr(async_engine, "LLMEngine", GatedEngine)
    st = ServerThread(EngineConfig(model=tiny_llama_dir, **TINY_OPTIONS), stall_timeout_s=0.5,
                      health_check_interval_s=0.05)

    async def main():
        async with grpc.aio.insecure_channel(st.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = engine_pb2_grpc.EngineStub(channel)

            async def status(service: str = "") -> int:
                return (await health.Check(health_pb2.HealthCheckRequest(service=service))).status

            # Loading: NOT_SERVING, and Generate is refused as UNAVAILABLE.
            assert await status() == NOT_SERVING and await status("pagoda.v1.Engine") == NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, request("early", "x"))
            assert info.value.code() == CODES.UNAVAILABLE and "loading" in info.value.details()
            gate.set()
            await wait_until(lambda: _is(status(), SERVING))
            assert await status("pagoda.v1.Engine") == SERVING

            # A step that takes longer than stall_timeout_s: NOT_SERVING while it lasts, then SERVING.
            st.slow_down_steps(1.5)
            stalled = asyncio.create_task(generate(stub, request("stall", "x", max_tokens=2)))
            await wait_until(lambda: _is(status(), NOT_SERVING), timeout=10, interval=0.02)
            assert not (await stub.GetLoad(engine_pb2.GetLoadRequest())).accepting
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, request("during-stall", "x"))
            assert info.value.code() == CODES.UNAVAILABLE and "stalled" in info.value.details()
            assert (await stalled).finish_reason
            del st.server.engine.engine.step  # back to the class's
            await wait_until(lambda: _is(status(), SERVING), timeout=10)

            # Graceful shutdown: the stream in flight finishes, a new one is refused as UNAVAILABLE.
            st.slow_down_steps(0.01)
            in_flight = Stream()
            call = stub.Generate(request("drain", "x", max_tokens=150, ignore_eos=True, temperature=0.0))
            in_flight.add(await call.read())
            shutdown = asyncio.run_coroutine_threadsafe(st.server.shutdown(60), st.loop)
            await wait_until(lambda: _async(st.server.draining))
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(stub, request("late", "x"))
            assert info.value.code() == CODES.UNAVAILABLE and "shutting down" in info.value.details()
            load = await stub.GetLoad(engine_pb2.GetLoadRequest())
            assert load.num_running_requests == 1 and not load.accepting, "the drained stream should be in flight"
            while (message := await call.read()) != grpc.aio.EOF:
                in_flight.add(message)
            await asyncio.wrap_future(shutdown)
            return in_flight

    try:
        in_flight = asyncio.run(main())
    finally:
        gate.set()
        st.close()
    assert in_flight.finish_reason == common_pb2.FINISH_REASON_LENGTH and len(in_flight.token_ids) == 150


async def _is(status_coro, expected) -> bool:
    return await status_coro == expected


def test_a_reader_that_stops_reading_is_cut_off_and_its_request_aborted(tiny_llama_dir):
    async def main():
        engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, **TINY_OPTIONS), max_stream_buffer=4)
        engine.start()
        await engine.wait_ready()
        try:
            return await check(engine)
        finally:
            await engine.stop()

    async def check(engine):
        streams = []

        async def consumer():
            stream = await engine.add_request("slow", [100, 101, 102], SamplingParams(max_tokens=900, ignore_eos=True))
            streams.append(stream)
            await stream.get()
            await asyncio.sleep(60)  # blocked elsewhere, as a handler is on a write to a client that stopped reading

        task = asyncio.create_task(consumer())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert isinstance(streams[0].error, StreamOverrun)
        with pytest.raises(StreamOverrun):
            await streams[0].get()

        async def idle():
            load = engine.load()
            return load.num_running_requests == 0 and load.num_free_blocks == load.num_total_blocks
        await wait_until(idle, timeout=10)
        # The engine still serves others.
        stream = await engine.add_request("next", [5, 6], SamplingParams(max_tokens=3))
        outputs = []
        while not (outputs and outputs[-1].finished):
            outputs += await stream.get()
        return outputs

    outputs = asyncio.run(main())
    assert len(outputs[-1].outputs[0].token_ids) == 3


def test_a_grpc_client_that_stops_reading_gets_resource_exhausted(tiny_llama_dir):
    st = ServerThread(EngineConfig(model=tiny_llama_dir, max_logprobs=2000, **TINY_OPTIONS), max_stream_buffer=8).wait_ready()
    st.slow_down_steps(0.05)  # 1000 tokens would take > 50 s: only the cut-off ends it sooner

    async def main():
        # No BDP probing: the flow-control window stays 64 KiB, so unread ~20 KB messages block the server's writes.
        async with grpc.aio.insecure_channel(st.target, options=[("grpc.http2.bdp_probe", 0)]) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            call = stub.Generate(request("deaf", [5, 6, 7], max_tokens=1000, ignore_eos=True, logprobs=2000))
            await call.read()
            await idle_load(stub)  # the engine dropped the request while the client was not reading
            with pytest.raises(grpc.aio.AioRpcError) as info:
                while await call.read() != grpc.aio.EOF:
                    pass
            return info.value

    try:
        error = asyncio.run(main())
    finally:
        st.close()
    assert error.code() == CODES.RESOURCE_EXHAUSTED and "behind" in error.details()


def test_a_request_cancelled_while_its_add_is_queued_is_aborted(tiny_llama_dir):
    async def main():
        engine = AsyncEngine(EngineConfig(model=tiny_llama_dir, **TINY_OPTIONS))
        engine.start()
        await engine.wait_ready()
        step = engine.engine.step

        def slow_step():
            time.sleep(0.3)
            return step()

        engine.engine.step = slow_step
        try:
            first = await engine.add_request("first", [5, 6], SamplingParams(max_tokens=3))
            # The loop is inside a 0.3 s step: this add waits in the command queue when it is cancelled.
            late = asyncio.create_task(engine.add_request("late", [7, 8], SamplingParams(max_tokens=900)))
            await asyncio.sleep(0.05)
            late.cancel()
            outputs = []
            while not (outputs and outputs[-1].finished):
                outputs += await first.get()

            async def idle():
                load = engine.load()
                return load.num_running_requests == 0 and load.num_waiting_requests == 0
            await wait_until(idle, timeout=5)  # "late" would run 900 slow steps had it not been aborted
            return late
        finally:
            await engine.stop()

    late = asyncio.run(main())
    assert late.cancelled()


def test_a_dead_engine_loop_fails_its_streams_and_is_not_serving(tiny_llama_dir):
    st = ServerThread(EngineConfig(model=tiny_llama_dir, **TINY_OPTIONS), health_check_interval_s=0.05).wait_ready()
    engine = st.server.engine.engine
    step = engine.step

    def failing_step():
        if engine.scheduler.running and engine.scheduler.running[0].num_output_tokens >= 3:
            raise RuntimeError("injected fault")
        return step()

    engine.step = failing_step

    async def main():
        async with grpc.aio.insecure_channel(st.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await generate(engine_pb2_grpc.EngineStub(channel), request("doomed", "x", max_tokens=50, ignore_eos=True))

            async def not_serving():
                return (await health.Check(health_pb2.HealthCheckRequest())).status == NOT_SERVING
            await wait_until(not_serving, timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as later:
                await generate(engine_pb2_grpc.EngineStub(channel), request("later", "x"))
            return info.value, later.value

    try:
        error, later = asyncio.run(main())
    finally:
        st.close()
    assert error.code() == CODES.UNAVAILABLE and "injected fault" in error.details()
    assert later.code() == CODES.UNAVAILABLE and "died" in later.details()


def test_serve_options_come_from_the_command_line_or_pagoda_variables(monkeypatch):
    from engine_service.__main__ import build_parser

    monkeypatch.setenv("PAGODA_MODEL", "/models/x.gguf")
    monkeypatch.setenv("PAGODA_PORT", "6000")
    monkeypatch.setenv("PAGODA_KV_CACHE_MEMORY_BYTES", "512MiB")
    monkeypatch.setenv("PAGODA_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("PAGODA_KV_CACHE_DTYPE", "fp8_e5m2")
    args = build_parser().parse_args(["serve", "--port", "7000", "--max-num-seqs", "8"])
    assert (args.model, args.port, args.max_num_seqs) == ("/models/x.gguf", 7000, 8)
    assert args.kv_cache_memory_bytes == 512 << 20 and args.enable_prefix_caching is False
    # Every engine option reaches EngineConfig under its own name (serve builds it so).
    from engine_service.__main__ import ENGINE_OPTIONS
    config = EngineConfig(model=args.model, **{name: getattr(args, name) for name in ENGINE_OPTIONS})
    assert (config.kv_cache_dtype, config.max_num_seqs, config.enable_prefix_caching) == ("fp8_e5m2", 8, False)
    assert build_parser().parse_args(["serve", "--kv-cache-dtype", "auto"]).kv_cache_dtype == "auto"
    fp8 = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"]).kv_cache_dtype  # vLLM's e4m3 name
    assert EngineConfig(kv_cache_dtype=fp8).torch_kv_cache_dtype == torch.float8_e4m3fn
    monkeypatch.setenv("PAGODA_DTYPE", "float64")
    with pytest.raises(SystemExit):
        build_parser()
