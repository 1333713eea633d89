"""Router parts without servers: validation (and its agreement with the engine's SamplingParams),
the tokenizer against transformers, the bearer-token check, the SDK's retry rule, configuration."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import redis.asyncio as aioredis

from pagoda.v1 import common_pb2, router_pb2
from router.auth import BearerTokenInterceptor
from router.client import _Retry, build_request
from router.config import RouterConfig
from router.registry import EngineHeartbeat
from router.server import RouterServer
from router.tokenizer import PromptTokenizer
from router.validation import Limits, ModelLimits, prefix_key, validate

MODEL = ModelLimits("m", max_model_len=64, vocab_size=49152, max_logprobs=20, block_size=16)


@pytest.fixture(scope="module")
def tokenizer(bundled_dir) -> PromptTokenizer:
    return PromptTokenizer.from_dir(bundled_dir)


def test_tokenizer_matches_the_engines_transformers_tokenizer(tokenizer, bundled_dir):
    from engine_service.model_loader import load_tokenizer

    reference = load_tokenizer(bundled_dir)
    for text in ["Hello, my name is", "  multi\n space ü 日本語 🙂", "<|im_start|>user\nhi<|im_end|>", "a" * 300]:
        assert tokenizer.encode(text) == reference.encode(text)
    conversations = [[{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]
    for messages in conversations:
        text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == reference.encode(text, add_special_tokens=False)


BAD_SAMPLING = [("temperature", -0.5), ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("min_p", 1.5),
                ("presence_penalty", 2.5), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
                ("max_tokens", 0), ("n", 0)]


@pytest.mark.parametrize("name,value", BAD_SAMPLING)
def test_router_refuses_what_the_engine_refuses(tokenizer, name, value):
    from engine_service.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})
    request = router_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(**{name: value}))
    with pytest.raises(ValueError, match=f"sampling.{name}"):
        validate(request, tokenizer, MODEL, Limits(), "r")


def test_good_values_pass_both(tokenizer):
    from engine_service.sampling_params import SamplingParams

    good = dict(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, presence_penalty=1.0, frequency_penalty=-1.0,
                repetition_penalty=1.1, max_tokens=8, min_tokens=2, n=2, seed=7, logprobs=5, stop=["\n"],
                stop_token_ids=[2], logit_bias={2: 1.5, 9: -100.0}, allowed_token_ids=[2, 3, 9],
                bad_words=["darn", " heck it"])
    SamplingParams(**good)
    valid = validate(router_pb2.GenerateRequest(prompt="hi", priority=3, sampling=common_pb2.SamplingParams(**good)),
                     tokenizer, MODEL, Limits(), "rid")
    assert valid.engine_request.request_id == "rid" and valid.priority == 3
    assert list(valid.engine_request.prompt_token_ids.ids) == tokenizer.encode("hi") == valid.prompt_token_ids
    assert valid.engine_request.sampling_params.max_tokens == 8 and valid.engine_request.priority == 3
    sent = valid.engine_request.sampling_params
    assert dict(sent.logit_bias) == {2: 1.5, 9: -100.0} and list(sent.allowed_token_ids) == [2, 3, 9]
    assert list(sent.bad_words) == ["darn", " heck it"]


@pytest.mark.parametrize("sampling, message", [
    ({"logit_bias": {49152: 1.0}}, r"sampling\.logit_bias must be token ids in the vocabulary \[0, 49152\), got 49152"),
    ({"logit_bias": {3: float("nan")}}, r"sampling\.logit_bias must be biases that are numbers below \+inf, got nan"),
    ({"logit_bias": {3: float("inf")}}, r"sampling\.logit_bias must be biases"),
    ({"logit_bias": {t: 1.0 for t in range(301)}}, r"sampling\.logit_bias must be at most 300 entries, got '301 entries'"),
    ({"allowed_token_ids": [4, 60000]}, r"sampling\.allowed_token_ids must be ids in the vocabulary"),
    ({"bad_words": ["a"] * 65}, r"sampling\.bad_words must be at most 64 words, got '65 words'"),
    ({"bad_words": ["a", " \t"]}, r"sampling\.bad_words must be words that are not all whitespace, of at most 256"),
    ({"bad_words": ["x" * 257]}, r"sampling\.bad_words must be words .* got 'xxxx"),
])
def test_bias_fields_are_checked(tokenizer, sampling, message):
    with pytest.raises(ValueError, match=message):
        validate(router_pb2.GenerateRequest(prompt="hi", sampling=common_pb2.SamplingParams(**sampling)), tokenizer,
                 MODEL, Limits(), "r")


def test_truncate_prompt_tokens_before_the_length_check(tokenizer):
    ids = list(range(100, 200))  # 100 tokens; max_model_len 64

    def sent(k):
        sampling = common_pb2.SamplingParams(truncate_prompt_tokens=k)
        valid = validate(router_pb2.GenerateRequest(prompt_token_ids=router_pb2.PromptTokenIds(ids=ids),
                                                    sampling=sampling), tokenizer, MODEL, Limits(), "r")
        assert valid.prompt_token_ids == list(valid.engine_request.prompt_token_ids.ids)
        return valid.prompt_token_ids

    assert sent(10) == ids[-10:] and sent(-1) == ids[-63:] and sent(63) == ids[-63:]
    assert sent(10) != ids[:10]
    with pytest.raises(ValueError, match="prompt_token_ids has 100 tokens, but max_model_len is 64"):
        sent(100)
    with pytest.raises(ValueError, match=r"sampling\.truncate_prompt_tokens must be an integer >= 1, or -1"):
        sent(0)


def test_prompt_length_limit_and_prefix_key(tokenizer):
    ids = list(range(100, 163))  # 63 tokens: the most max_model_len 64 allows
    validate(router_pb2.GenerateRequest(prompt_token_ids=router_pb2.PromptTokenIds(ids=ids)), tokenizer, MODEL,
             Limits(), "r")
    with pytest.raises(ValueError, match="prompt_token_ids has 64 tokens, but max_model_len is 64"):
        validate(router_pb2.GenerateRequest(prompt_token_ids=router_pb2.PromptTokenIds(ids=ids + [5])), tokenizer,
                 MODEL, Limits(), "r")
    # Same leading whole blocks, same key; shorter than one block, no key.
    assert prefix_key(ids, 16, 32) == prefix_key(ids[:48] + [1, 2, 3], 16, 32) != prefix_key(ids[1:], 16, 32)
    assert prefix_key(ids[:32], 16, 32) == prefix_key(ids[:40], 16, 32)
    assert prefix_key(ids[:15], 16, 64) == ""


def test_bearer_token_check():
    check = BearerTokenInterceptor(("alpha", "beta")).check
    assert check([("authorization", "Bearer beta")]) is None
    assert check([("authorization", "bearer alpha")]) is None
    assert check([])[0] == grpc.StatusCode.UNAUTHENTICATED
    assert check([("authorization", "Basic alpha")])[0] == grpc.StatusCode.UNAUTHENTICATED
    assert check([("authorization", "Bearer alph")])[0] == grpc.StatusCode.PERMISSION_DENIED
    assert check([("authorization", "Bearer alphaX")])[0] == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(ValueError):
        BearerTokenInterceptor(("",))


class _Error(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code


def test_sdk_retries_only_safe_failures():
    retry = _Retry(max_retries=2, backoff_s=0.01, timeout=None)
    assert retry.next_delay(_Error(grpc.StatusCode.INVALID_ARGUMENT), received=False) is None
    assert retry.next_delay(_Error(grpc.StatusCode.DEADLINE_EXCEEDED), received=False) is None
    assert retry.next_delay(_Error(grpc.StatusCode.UNAVAILABLE), received=True) is None, "output was received"
    assert retry.next_delay(_Error(grpc.StatusCode.UNAVAILABLE), received=False) > 0
    assert retry.next_delay(_Error(grpc.StatusCode.RESOURCE_EXHAUSTED), received=False) > 0
    assert retry.next_delay(_Error(grpc.StatusCode.UNAVAILABLE), received=False) is None, "max_retries reached"
    no_time = _Retry(max_retries=5, backoff_s=10.0, timeout=0.5)
    assert no_time.next_delay(_Error(grpc.StatusCode.UNAVAILABLE), received=False) is None, "past the deadline"


def test_build_request():
    r = build_request("hi", max_tokens=4, temperature=0.0, priority=2)
    assert r.prompt == "hi" and r.sampling.max_tokens == 4 and r.sampling.HasField("temperature") and r.request_id
    assert list(build_request([1, 2]).prompt_token_ids.ids) == [1, 2]
    assert build_request(messages=[{"role": "user", "content": "x"}]).messages.messages[0].content == "x"
    with pytest.raises(TypeError, match="max_new_tokens"):
        build_request("hi", max_new_tokens=4)


def test_router_config_validation():
    for bad in (dict(max_queue_size=0), dict(lease_ttl_s=0), dict(maintenance_interval_s=3, lease_ttl_s=5),
                dict(tls_cert="c"), dict(tls_client_ca="ca"), dict(engine_tls_cert="c", engine_tls_key="k"),
                dict(auth_tokens=("",)), dict(router_id="has space"), dict(engine_max_waiting=-1)):
        with pytest.raises(ValueError):
            RouterConfig(**bad)
    assert "s3cret" not in repr(RouterConfig(auth_tokens=("s3cret",), redis_password="pw"))


def test_compose_file_uses_real_options():
    """docker-compose.yml cannot run here (no Docker): check that every PAGODA_* variable it sets
    is an option of the command it configures, and its wiring (two engines, one router, one Redis)."""
    import argparse
    from pathlib import Path

    import yaml

    from engine_service.__main__ import build_parser as engine_parser
    from router.__main__ import build_parser as router_parser

    def dests(parser: argparse.ArgumentParser, command: str) -> set[str]:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
        return {a.dest for a in sub._actions if a.option_strings}

    compose = yaml.safe_load((Path(__file__).resolve().parents[1] / "docker-compose.yml").read_text())
    services = compose["services"]
    assert sorted(services) == ["engine-1", "engine-2", "redis", "router"]
    engine_options, router_options = dests(engine_parser(), "serve"), dests(router_parser(), "serve")
    for name, service in services.items():
        env = service.get("environment", {})
        if name.startswith("engine"):
            assert service["command"][:3] == ["python", "-m", "engine_service"]
            assert {k.removeprefix("PAGODA_").lower() for k in env if k.startswith("PAGODA_")} <= engine_options
            # Engines share the host's cores with each other and the router: OpenMP threads must not spin.
            assert set(env) - {k for k in env if k.startswith("PAGODA_")} == {"OMP_WAIT_POLICY"}
            assert env["OMP_WAIT_POLICY"] == "PASSIVE"
            assert env["PAGODA_REDIS_URL"].startswith("redis://redis:")
        elif name == "router":
            assert service["command"][:3] == ["python", "-m", "router"]
            assert {k.removeprefix("PAGODA_ROUTER_").lower() for k in env} <= router_options


def test_colocated_engines_do_not_spin(monkeypatch):
    """Engines started next to a router (make run, bench/serve.py) get passive OpenMP waiting, unless
    the caller chose a policy."""
    from router.stack import colocated_engine_env

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("PAGODA_MODEL", "bundled")
    env = colocated_engine_env()
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["PAGODA_MODEL"] == "bundled"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert colocated_engine_env()["OMP_WAIT_POLICY"] == "ACTIVE"


def test_shutdown_stages_are_bounded_even_when_a_stage_ignores_cancellation():
    async def stubborn():
        # Swallows its first cancellation and goes on, as a stop waiting on a peer might.
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(30)

    async def failing():
        raise RuntimeError("stage broke")

    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        await RouterServer._bounded(stubborn(), "stubborn", timeout_s=0.2)
        took = loop.time() - start
        await RouterServer._bounded(failing(), "failing")  # logged, not raised: the next stages still run
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()
        return took

    assert asyncio.run(main()) < 2.0


def test_heartbeat_stops_even_when_redis_turns_its_cancellation_into_an_error():
    async def converts_cancellation(record, ttl_s):
        # A Redis call that, cancelled mid-command, raises a connection error instead: the loop
        # retries such errors, so cancelling alone would leave it running.
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            raise aioredis.ConnectionError("connection closed while cancelled") from None

    async def main():
        loop = asyncio.get_running_loop()
        # The client is never used: no heartbeat succeeds, so there is nothing to deregister.
        hb = EngineHeartbeat(aioredis.Redis(), lambda: "record", interval_s=0.05, ttl_s=1.0)
        hb.registry.heartbeat = converts_cancellation
        hb.start()
        await asyncio.sleep(0.1)
        start = loop.time()
        await hb.stop(timeout_s=3.0)
        took = loop.time() - start
        await asyncio.sleep(0)
        return took, hb._task.done()

    took, done = asyncio.run(main())
    assert done and took < 1.5, (took, done)
