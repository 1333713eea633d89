"""Structured outputs: constraints are checked at submission, masks cover exactly the allowed tokens,
unconstrained rows in the same batch are untouched, and the bundled model's constrained generations
parse and validate (JSON schema with ``jsonschema``, regex, choice, grammar), offline and over gRPC."""
from __future__ import annotations

import asyncio
import json
import re

import grpc
import jsonschema
import pytest
import torch

from engine_service import LLM, EngineConfig, LLMEngine, SamplingParams, StructuredOutputsParams
from engine_service.server import sampling_params_from_proto
from engine_service.structured_output import GrammarMasker
from pagoda.v1 import common_pb2, engine_pb2_grpc
from tests.test_engine_service import ServerThread, generate, request

# Nested object, enum, array and required fields, bounded so that a completion always fits.
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DATE_REGEX = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
CHOICES = ["positive", "negative", "neutral", "mixed feelings"]
# GBNF: a sum of two to four numbers of at most three digits.
SUM_GRAMMAR = 'root ::= num ("+" num){1,3}\nnum ::= [1-9] [0-9]{0,2}'
SUM_RE = r"[1-9][0-9]{0,2}(\+[1-9][0-9]{0,2}){1,3}"


# ---- the parameters' shape --------------------------------------------------------------------

@pytest.mark.parametrize("spec, message", [
    ({}, "exactly one of"),
    ({"json": {"type": "object"}, "regex": "a+"}, "exactly one of"),
    ({"choice": "yes"}, "choice must be a list"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"grammar": "  "}, "grammar must be a non-empty string"),
    ({"json": "{not json"}, "json is not valid JSON"),
    ({"json": 3}, "json must be a JSON schema"),
    ({"jsn": {}}, "unknown keys \\['jsn'\\]"),
])
def test_bad_shapes_are_refused_at_construction_naming_the_field(spec, message):
    with pytest.raises(ValueError, match=f"SamplingParams.structured_outputs.*{message}"):
        SamplingParams(structured_outputs=spec)


def test_a_dict_becomes_structured_outputs_params():
    p = SamplingParams(structured_outputs={"choice": ("a", "b")})
    assert p.structured_outputs == StructuredOutputsParams(choice=["a", "b"])
    assert p.structured_outputs.kind == "choice"
    assert SamplingParams(structured_outputs={"json": {"b": 1, "a": 2}}).structured_outputs.cache_key() == \
        SamplingParams(structured_outputs={"json": {"a": 2, "b": 1}}).structured_outputs.cache_key()


# ---- masks ---------------------------------------------------------------------------------------

def test_additive_mask_is_minus_inf_exactly_where_the_bitmask_bit_is_clear():
    vocab_size = 49152 - 7  # not a multiple of 32: the last word is partly padding
    masker = GrammarMasker(vocab_size, num_threads=1)
    g = torch.Generator().manual_seed(0)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, masker.num_words), dtype=torch.int32, generator=g)
    mask = masker.additive_mask(bitmask, torch.device("cpu"))
    token = torch.arange(vocab_size)
    allowed = ((bitmask[:, token // 32] >> (token % 32)) & 1).bool()
    assert mask.shape == (5, vocab_size)
    assert torch.equal(mask == 0, allowed) and torch.equal(torch.isneginf(mask), ~allowed)


# ---- the engine (tiny random-weight model: constraints hold whatever the model prefers) ---------

@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                                  kv_cache_memory_bytes=32 << 20))


def run(engine: LLMEngine, done: dict | None = None) -> dict:
    done = {} if done is None else done
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.mark.parametrize("field, spec, detail", [
    ("regex", {"regex": "[a-"}, "unclosed character class"),
    ("json", {"json": {"type": "objekt"}}, "objekt"),
    ("json", {"json": {"type": "string", "pattern": "(x"}}, "regex parse error"),
    ("grammar", {"grammar": "root ::= missing_rule"}, "missing_rule"),
    ("grammar", {"grammar": "start: undefined_name"}, "undefined_name"),
])
def test_an_invalid_constraint_is_refused_at_submission_and_nothing_in_flight_is_lost(tiny_engine, field, spec,
                                                                                       detail):
    engine = tiny_engine
    engine.add_request("in-flight", "Hello there", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("constrained", "Hello", SamplingParams(max_tokens=20, structured_outputs={"regex": "[a-z]{4}"}))
    done = {out.request_id: out for out in engine.step() if out.finished}
    live = dict(engine.requests)
    num_structured = engine.num_structured_requests
    with pytest.raises(ValueError, match=rf"SamplingParams\.structured_outputs\.{field} is invalid: .*{detail}"):
        engine.add_request("bad", "Hello", SamplingParams(structured_outputs=spec))
    assert engine.requests == live and engine.num_structured_requests == num_structured
    done = run(engine, done)
    assert len(done["in-flight"].outputs[0].token_ids) == 6
    assert re.fullmatch("[a-z]{4}", done["constrained"].outputs[0].text)
    assert engine.num_structured_requests == 0


def test_constrained_rows_leave_the_unconstrained_rows_of_their_batch_unchanged(tiny_engine):
    engine = tiny_engine
    prompts = [f"Prompt number {i} says" for i in range(8)]
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"alone-{i}", p, plain)
    alone = run(engine)

    constraints = [{"regex": "[a-z]{3,8}"}, {"choice": CHOICES}, {"json": {"type": "object", "properties": {
        "n": {"type": "integer", "maximum": 999}}, "required": ["n"], "additionalProperties": False},
        "disable_any_whitespace": True}, {"grammar": SUM_GRAMMAR}]
    for i, p in enumerate(prompts):
        engine.add_request(f"mixed-{i}", p, plain)
        c = constraints[i % len(constraints)]
        # n=2 and seeds: each forked completion carries its own grammar state.
        engine.add_request(f"constrained-{i}", p, SamplingParams(temperature=1.0, seed=i, n=2, max_tokens=40,
                                                                 structured_outputs=c))
    assert engine.num_structured_requests == 8
    mixed = run(engine)
    for i in range(8):
        assert mixed[f"mixed-{i}"].outputs[0].token_ids == alone[f"alone-{i}"].outputs[0].token_ids
        c = constraints[i % len(constraints)]
        for completion in mixed[f"constrained-{i}"].outputs:
            text = completion.text
            assert completion.finish_reason == "stop", (c, text)
            if "regex" in c:
                assert re.fullmatch(c["regex"], text)
            elif "choice" in c:
                assert text in CHOICES
            elif "json" in c:
                jsonschema.validate(json.loads(text), c["json"])
            else:
                assert re.fullmatch(SUM_RE, text), text
    assert engine.num_structured_requests == 0


def test_aborting_a_constrained_request_releases_it(tiny_engine):
    engine = tiny_engine
    engine.add_request("to-abort", "Hi", SamplingParams(max_tokens=50, structured_outputs={"regex": "[a-z]+"}))
    engine.step()
    engine.abort_request("to-abort")
    assert engine.num_structured_requests == 0 and not engine.has_unfinished_requests()


# ---- the bundled model ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled_llm(bundled_dir) -> LLM:
    return LLM(None, dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)


@pytest.mark.slow
def test_30_json_schema_generations_parse_and_validate(bundled_llm):
    conversations = [[{"role": "user", "content": f"Describe person number {i} as JSON."}] for i in range(30)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=120,
                             structured_outputs={"json": PERSON_SCHEMA, "disable_any_whitespace": True})
              for i in range(30)]
    outputs = bundled_llm.chat(conversations, params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    for text, o in zip(texts, outputs):
        assert o.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON_SCHEMA)
    assert len(set(texts)) > 20, "sampling under the schema should still vary"


@pytest.mark.slow
def test_30_regex_30_choice_and_grammar_generations_match(bundled_llm):
    prompts = [f"Write the date of event {i}:" for i in range(30)] + \
              [f"Review {i}: the film was long. Sentiment:" for i in range(30)] + \
              [f"Add some numbers, example {i}:" for i in range(10)]
    params = ([SamplingParams(temperature=1.0, seed=i, max_tokens=16, structured_outputs={"regex": DATE_REGEX})
               for i in range(30)]
              + [SamplingParams(temperature=1.0, seed=i, max_tokens=8, structured_outputs={"choice": CHOICES})
                 for i in range(30)]
              + [SamplingParams(temperature=1.0, seed=i, max_tokens=24, structured_outputs={"grammar": SUM_GRAMMAR})
                 for i in range(10)])
    outputs = bundled_llm.generate(prompts, params, use_tqdm=False)
    dates, choices, sums = outputs[:30], outputs[30:60], outputs[60:]
    for o in dates:
        assert re.fullmatch(DATE_REGEX, o.outputs[0].text) and o.outputs[0].finish_reason == "stop", o.outputs[0]
    assert all(o.outputs[0].text in CHOICES for o in choices)
    assert all(re.fullmatch(SUM_RE, o.outputs[0].text) for o in sums), [o.outputs[0].text for o in sums]


# ---- gRPC ------------------------------------------------------------------------------------------

def test_proto_structured_outputs_convert_for_every_kind():
    cases = {
        "json": (common_pb2.StructuredOutputs(json='{"type": "object"}', disable_any_whitespace=True),
                 StructuredOutputsParams(json='{"type": "object"}', disable_any_whitespace=True)),
        "regex": (common_pb2.StructuredOutputs(regex="a+"), StructuredOutputsParams(regex="a+")),
        "choice": (common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=["x", "y"])),
                   StructuredOutputsParams(choice=["x", "y"])),
        "grammar": (common_pb2.StructuredOutputs(grammar='root ::= "a"'), StructuredOutputsParams(grammar='root ::= "a"')),
        "json_object": (common_pb2.StructuredOutputs(json_object=True), StructuredOutputsParams(json_object=True)),
    }
    for kind, (proto, expected) in cases.items():
        got = sampling_params_from_proto(common_pb2.SamplingParams(structured_outputs=proto)).structured_outputs
        assert got == expected, kind
    assert sampling_params_from_proto(common_pb2.SamplingParams()).structured_outputs is None
    with pytest.raises(ValueError, match="structured_outputs.choice must be a non-empty list"):
        sampling_params_from_proto(common_pb2.SamplingParams(
            structured_outputs=common_pb2.StructuredOutputs(choice=common_pb2.Choices())))


def test_grpc_constrained_streams_and_invalid_argument_naming_the_field(tiny_llama_dir):
    server = ServerThread(EngineConfig(model=tiny_llama_dir, dtype="float32", max_model_len=256,
                                       kv_cache_memory_bytes=32 << 20)).wait_ready()
    try:
        async def main():
            async with grpc.aio.insecure_channel(server.target) as channel:
                stub = engine_pb2_grpc.EngineStub(channel)
                choice = common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=CHOICES))
                good = [generate(stub, request(f"re-{i}", "Hello", max_tokens=16, seed=i,
                                               structured_outputs=common_pb2.StructuredOutputs(regex=DATE_REGEX)))
                        for i in range(4)]
                good += [generate(stub, request(f"choice-{i}", "Hi", max_tokens=8, seed=i, structured_outputs=choice))
                         for i in range(4)]
                good += [generate(stub, request("plain", "Hello", temperature=0.0, max_tokens=10, ignore_eos=True))]
                bad = generate(stub, request("bad", "Hello", structured_outputs=common_pb2.StructuredOutputs(
                    json='{"type": "objekt"}')))
                return await asyncio.gather(*good, bad, return_exceptions=True)

        *streams, plain, bad = asyncio.run(main())
        assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "SamplingParams.structured_outputs.json is invalid" in bad.details() and "objekt" in bad.details()
        assert all(re.fullmatch(DATE_REGEX, s.text) for s in streams[:4]), [s.text for s in streams[:4]]
        assert all(s.text in CHOICES for s in streams[4:])
        assert len(plain.token_ids) == 10
    finally:
        server.close()
