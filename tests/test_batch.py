"""Batch jobs: rows in OpenAI's batch format (and the plain form) through the in-process engine and
through a real engine service over gRPC; one output row per input row, bad rows as error rows,
duplicate ids refused up front, and a job killed with SIGKILL half-way resumes with each id once."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema
import pytest

from engine_service.batch import DuplicateIds, main, read_done, run_job
from engine_service.batch_backends import sampling_params_to_proto
from engine_service.batch_rows import (BatchResult, Choice, PositionLogprobs, RowError, TokenLogprob, parse_row,
                                       success_row)

ROOT = Path(__file__).resolve().parents[1]
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory-bytes", "256MiB"]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "confidence": {
    "type": "integer", "minimum": 0, "maximum": 100}}, "required": ["answer", "confidence"],
    "additionalProperties": False}
SUBJECTS = ["the sea", "a red fox", "Paris", "prime numbers", "the moon", "bread", "a violin", "winter"]


def make_rows(n: int = 200) -> tuple[list[str], dict[str, str]]:
    """``n`` JSONL lines: OpenAI chat and completions rows, plain rows, and bad rows.

    Returns the lines and, for each bad row's key, the error code expected for it."""
    lines, bad = [], {}
    for i in range(n):
        subject = SUBJECTS[i % len(SUBJECTS)]
        kind = i % 20
        if kind == 0:  # a bad row of some sort, every 20th
            j = i // 20
            key, line, code = [
                (f"line:{i + 1}", '{"custom_id": "broken", "body": {', "invalid_json"),
                (f"row-{i}", json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                                         "body": {"messages": [{"role": "user", "content": "hi"}], "tools": []}}),
                 "invalid_request"),
                (f"row-{i}", json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                                         "body": {"prompt": "word " * 700, "max_tokens": 4}}), "invalid_request"),
                (f"row-{i}", json.dumps({"id": f"row-{i}", "prompt": "x", "temperature": -1}), "invalid_request"),
                (f"row-{i}", json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                                         "body": {"prompt": "x", "structured_outputs": {"regex": "[a-"}}}),
                 "invalid_request"),
                (f"row-{i}", json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/embeddings",
                                         "body": {"input": "x"}}), "invalid_request"),
                (f"row-{i}", json.dumps({"custom_id": f"row-{i}", "extra": 1, "method": "POST",
                                         "url": "/v1/completions", "body": {"prompt": "x"}}), "invalid_request"),
                (f"row-{i}", json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                                         "body": {"messages": [{"role": "user", "content": "x"}],
                                                  "response_format": {"type": "xml"}}}), "invalid_request"),
                (f"row-{i}", json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                                         "body": {"messages": []}}), "invalid_request"),
                (f"row-{i}", json.dumps({"id": f"row-{i}"}), "invalid_request"),
            ][j % 10]
            lines.append(line)
            bad[key] = code
        elif kind < 10:
            lines.append(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"model": "smol", "messages": [
                                         {"role": "user", "content": f"Say something about {subject}."}],
                                         "max_tokens": 6, "temperature": 0.7, "seed": i}}))
        elif kind < 15:
            lines.append(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/completions",
                                     "body": {"prompt": f"A short fact about {subject}:", "max_tokens": 6,
                                              "temperature": 0, "stop": ["\n\n"]}}))
        elif kind < 18:
            lines.append(json.dumps({"id": f"row-{i}", "prompt": f"{subject.capitalize()} is", "max_tokens": 5}))
        else:  # structured: JSON schema through response_format
            lines.append(json.dumps({"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": {"messages": [{"role": "user", "content": f"Is {subject} blue? JSON."}],
                                              "max_tokens": 48, "seed": i, "response_format": {
                                                  "type": "json_schema", "json_schema": {"name": "a",
                                                                                         "schema": SCHEMA}}}}))
    return lines, bad


def input_keys(lines: list[str]) -> list[str]:
    keys = []
    for number, line in enumerate(lines, start=1):
        try:
            obj = json.loads(line)
        except ValueError:
            keys.append(f"line:{number}")
            continue
        keys.append(str(obj.get("custom_id", obj.get("id"))))
    return keys


def output_rows(path: Path) -> dict[str, dict]:
    """Output rows by key; asserts each key appears once."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    keys = [r["custom_id"] if r["custom_id"] is not None else f"line:{r['line']}" for r in rows]
    repeated = [k for k, c in Counter(keys).items() if c > 1]
    assert not repeated, f"ids answered more than once: {repeated}"
    return dict(zip(keys, rows))


def check_results(lines: list[str], bad: dict[str, str], path: Path) -> dict[str, dict]:
    rows = output_rows(path)
    assert sorted(rows) == sorted(input_keys(lines)), "output ids differ from input ids"
    for key, row in rows.items():
        if key in bad:
            assert row["response"] is None and row["error"]["code"] == bad[key], (key, row)
            continue
        assert row["error"] is None, (key, row)
        body = row["response"]["body"]
        assert row["response"]["status_code"] == 200
        choice = body["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        usage = body["usage"]
        assert usage["prompt_tokens"] > 0 and usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if body["object"] == "chat.completion":
            content = choice["message"]["content"]
            assert choice["message"]["role"] == "assistant" and isinstance(content, str)
            n = int(key.split("-")[1])
            if n % 20 >= 18:
                jsonschema.validate(json.loads(content), SCHEMA)
            else:
                assert body["model"] == "smol" and 1 <= usage["completion_tokens"] <= 6
        else:
            assert body["object"] == "text_completion" and isinstance(choice["text"], str)
    return rows


# ---- rows -----------------------------------------------------------------------------------------

def test_rows_map_to_sampling_params_and_endpoints():
    chat = parse_row(json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_completion_tokens": 7, "temperature": 0.5, "top_p": 0.9, "stop": "END", "seed": 3,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}}}), 1)
    assert (chat.key, chat.custom_id, chat.endpoint, chat.model) == ("a", "a", "chat", "m")
    assert chat.messages == [{"role": "user", "content": "hi"}]
    p = chat.params
    assert (p.max_tokens, p.temperature, p.top_p, p.stop, p.seed) == (7, 0.5, 0.9, ["END"], 3)
    assert p.structured_outputs.json == SCHEMA
    completion = parse_row(json.dumps({"custom_id": "b", "url": "/v1/completions", "body": {
        "prompt": [1, 2, 3], "response_format": {"type": "json_object"}}}), 2)
    assert completion.prompt == [1, 2, 3] and completion.params.max_tokens == 16
    assert completion.params.structured_outputs.json_object is True
    plain = parse_row('{"id": 7, "messages": [{"role": "user", "content": "x"}]}', 3)
    assert (plain.key, plain.endpoint, plain.params.max_tokens) == ("7", "chat", None)
    assert parse_row('{"id": "p", "prompt": "x", "structured_outputs": {"choice": ["a", "b"]}}', 4) \
        .params.structured_outputs.choice == ["a", "b"]


def test_logprob_fields_map_by_endpoint():
    """Chat: logprobs true (+ top_logprobs k); completions: logprobs k; both: vLLM's prompt_logprobs."""
    def params(url: str, **body):
        field = {"messages": [{"role": "user", "content": "x"}]} if "chat" in url else {"prompt": "x"}
        p = parse_row(json.dumps({"custom_id": "a", "url": url, "body": {**field, **body}}), 1).params
        return p.logprobs, p.prompt_logprobs

    assert params("/v1/chat/completions", logprobs=True, top_logprobs=4) == (4, None)
    assert params("/v1/chat/completions", logprobs=True) == (0, None)
    assert params("/v1/chat/completions", logprobs=False, prompt_logprobs=2) == (None, 2)
    assert params("/v1/completions", logprobs=2, prompt_logprobs=0) == (2, 0)
    assert params("/v1/completions") == (None, None)
    assert parse_row('{"id": "p", "prompt": "x", "logprobs": 1}', 1).params.logprobs == 1


def test_logit_bias_and_allowed_token_ids_map_to_sampling_params():
    row = parse_row(json.dumps({"custom_id": "a", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "x"}], "logit_bias": {"50256": -100, "7": 2.5},
        "allowed_token_ids": [7, 8], "bad_words": ["darn"]}}), 1)
    assert row.params.logit_bias == {50256: -100.0, 7: 2.5} and row.params.allowed_token_ids == [7, 8]
    assert row.params.bad_words == ["darn"]
    proto = sampling_params_to_proto(row.params)
    assert dict(proto.logit_bias) == {50256: -100.0, 7: 2.5} and list(proto.allowed_token_ids) == [7, 8]
    assert list(proto.bad_words) == ["darn"]
    assert not proto.HasField("truncate_prompt_tokens")
    row = parse_row('{"id": "t", "prompt": "x y z", "truncate_prompt_tokens": 2}', 2)
    assert row.params.truncate_prompt_tokens == 2
    assert sampling_params_to_proto(row.params).truncate_prompt_tokens == 2


@pytest.mark.parametrize("row, message", [
    ('{"custom_id": "a", ', r"line 5 is not valid JSON"),
    ('[1, 2]', r"must be a JSON object"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "suffix": "y"}}',
     r"unsupported field body\.suffix"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"messages": []}}',
     r"unsupported field body\.messages \('messages' belongs to the other endpoint\)"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "temperature": -1}}',
     r"SamplingParams\.temperature must be >= 0"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": ["x", "y"]}}', r"one prompt per row"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "stream": true}}', r"stream must be false"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"content": "x"}]}}',
     r"messages\[0\] must be an object with a 'role'"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], '
     '"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}}',
     r"response_format\.json_schema\.schema must be"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "response_format": {"type": "json_object"}, '
     '"structured_outputs": {"regex": "a"}}}', r"mutually exclusive"),
    ('{"custom_id": "", "url": "/v1/completions", "body": {"prompt": "x"}}', r"custom_id must be a non-empty string"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', r"method must be 'POST'"),
    ('{"id": "a", "prompt": "x", "colour": "red"}', r"unsupported field colour"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], '
     '"logprobs": 3}}', r"body\.logprobs must be true or false on /v1/chat/completions"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], '
     '"top_logprobs": 2}}', r"body\.top_logprobs needs body\.logprobs: true"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], '
     '"logprobs": true, "top_logprobs": -1}}', r"body\.top_logprobs must be an integer >= 0, got -1"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": true}}',
     r"body\.logprobs must be an integer >= 0, got True"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "top_logprobs": 2}}',
     r"unsupported field body\.top_logprobs"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "echo": 1}}', r"body\.echo must be true or false"),
    ('{"custom_id": "a", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], '
     '"echo": true}}', r"unsupported field body\.echo"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 0}}',
     r"body\.max_tokens must be >= 1 \(0 only with body\.echo: true\)"),
    ('{"id": "a", "prompt": "x", "prompt_logprobs": "2"}', r"^prompt_logprobs must be an integer >= 0, got '2'"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": {"7": 101}}}',
     r"body\.logit_bias\['7'\] must be a number in \[-100, 100\], got 101"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": {"seven": 1}}}',
     r"body\.logit_bias keys must be token ids, got 'seven'"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": [7]}}',
     r"body\.logit_bias must be an object of token id to bias, got list"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "allowed_token_ids": []}}',
     r"allowed_token_ids must be a non-empty list"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "bad_words": [""]}}',
     r"bad_words must be a list of strings"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "echo": true, "truncate_prompt_tokens": 4}}',
     r"body\.echo and body\.truncate_prompt_tokens cannot be used together"),
    ('{"id": "a", "prompt": "x", "truncate_prompt_tokens": 0}', r"truncate_prompt_tokens must be None, an integer >= 1"),
])
def test_bad_rows_become_row_errors_naming_the_field(row, message):
    with pytest.raises(RowError, match=message):
        parse_row(row, 5)


def test_logprobs_are_written_in_openai_shapes():
    """Chat: per token its text, logprob, UTF-8 bytes and exactly the top k; completions: tokens,
    token_logprobs, top k plus the sampled token as {text: logprob}, text offsets; vLLM's
    prompt_logprobs keyed by token id; -inf written as -9999 (the row is strict JSON)."""
    def t(token_id, text, logprob, rank):
        return TokenLogprob(token_id, text, logprob, rank)

    positions = [PositionLogprobs(t(5, "Hé", -0.25, 1), [t(5, "Hé", -0.25, 1), t(9, " a", -1.5, 2)]),
                 PositionLogprobs(t(7, "llo", -3.0, 4), [t(2, "y", -0.5, 1), t(3, "z", -1.0, 2)]),
                 PositionLogprobs(t(8, "!", float("-inf"), 49152), [t(4, "?", 0.0, 1), t(6, ".", float("-inf"), 2)])]
    prompt = [None, PositionLogprobs(t(11, "Hi", -2.0, 3), [t(12, "A", -0.1, 1)])]
    result = BatchResult("r", [Choice(0, "Héllo!", "length", 3, positions)], 2, 3, 0, prompt)
    chat = parse_row(json.dumps({"custom_id": "c", "url": "/v1/chat/completions", "body": {
        "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2, "prompt_logprobs": 1}}), 1)
    body = json.loads(json.dumps(success_row(chat, result, "m"), allow_nan=False))["response"]["body"]
    content = body["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == ["Hé", "llo", "!"]
    assert [c["logprob"] for c in content] == [-0.25, -3.0, -9999.0]
    assert content[0]["bytes"] == [72, 195, 169]
    assert content[1]["top_logprobs"] == [{"token": "y", "logprob": -0.5, "bytes": [121]},
                                          {"token": "z", "logprob": -1.0, "bytes": [122]}]
    assert content[2]["top_logprobs"][1]["logprob"] == -9999.0
    assert body["prompt_logprobs"] == [None, {"12": {"logprob": -0.1, "rank": 1, "decoded_token": "A"},
                                              "11": {"logprob": -2.0, "rank": 3, "decoded_token": "Hi"}}]

    completion = parse_row(json.dumps({"custom_id": "d", "url": "/v1/completions", "body": {
        "prompt": "x", "logprobs": 2}}), 2)
    body = json.loads(json.dumps(success_row(completion, result, "m"), allow_nan=False))["response"]["body"]
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["Hé", "llo", "!"] and lp["text_offset"] == [0, 2, 5]
    assert lp["token_logprobs"] == [-0.25, -3.0, -9999.0]
    assert lp["top_logprobs"] == [{"Hé": -0.25, " a": -1.5}, {"y": -0.5, "z": -1.0, "llo": -3.0},
                                  {"?": 0.0, ".": -9999.0, "!": -9999.0}]
    assert "prompt_logprobs" not in body["choices"][0], "only when the row asked"
    plain = success_row(parse_row('{"id": "p", "prompt": "x"}', 3), BatchResult("r", [Choice(0, "a", "stop", 1)], 1, 1), "m")
    assert plain["response"]["body"]["choices"][0]["logprobs"] is None


def test_echo_puts_the_prompt_first():
    """echo: the prompt's text, then its tokens' logprobs (the first null) before the completion's;
    max_tokens 0: the prompt alone, no completion tokens counted."""
    def t(token_id, text, logprob, rank=1):
        return TokenLogprob(token_id, text, logprob, rank)

    prompt = [None, PositionLogprobs(t(2, " b", -1.0, 2), [t(3, " c", -0.5), t(2, " b", -1.0, 2)])]
    generated = [PositionLogprobs(t(4, "!", -0.1), [t(4, "!", -0.1), t(5, "?", -2.0, 2)])]
    result = BatchResult("r", [Choice(0, "!", "length", 1, generated)], 2, 1, 0, prompt, prompt_text="a b",
                         first_prompt_token="a")

    def row(**body):
        return parse_row(json.dumps({"custom_id": "e", "url": "/v1/completions",
                                     "body": {"prompt": "a b", "echo": True, **body}}), 1)

    scored = row(max_tokens=0, logprobs=1)
    assert (scored.prompt_only, scored.params.max_tokens, scored.params.prompt_logprobs, scored.prompt_logprobs) == \
        (True, 1, 1, None)
    body = success_row(scored, result, "m")["response"]["body"]
    choice = body["choices"][0]
    assert (choice["text"], choice["finish_reason"], body["usage"]["completion_tokens"]) == ("a b", "length", 0)
    assert choice["logprobs"] == {"tokens": ["a", " b"], "token_logprobs": [None, -1.0],
                                  "top_logprobs": [None, {" c": -0.5, " b": -1.0}], "text_offset": [0, 1]}
    assert "prompt_logprobs" not in choice
    body = success_row(row(max_tokens=1, logprobs=1, prompt_logprobs=0), result, "m")["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == "a b!" and body["usage"]["completion_tokens"] == 1
    assert choice["logprobs"]["tokens"] == ["a", " b", "!"] and choice["logprobs"]["text_offset"] == [0, 1, 3]
    assert choice["logprobs"]["top_logprobs"][2] == {"!": -0.1}
    assert choice["prompt_logprobs"] == [None, {"2": {"logprob": -1.0, "rank": 2, "decoded_token": " b"}}]
    plain = success_row(row(max_tokens=1), BatchResult("r", [Choice(0, "!", "length", 1)], 2, 1, prompt_text="a b"),
                        "m")["response"]["body"]["choices"][0]
    assert (plain["text"], plain["logprobs"]) == ("a b!", None)


def test_duplicate_ids_are_refused_before_any_work(tmp_path, capsys):
    rows = [{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}},
            {"id": "b", "prompt": "y"}, {"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "z"}},
            {"id": "b", "prompt": "w"}, {"id": "c", "prompt": "v"}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    t0 = time.perf_counter()
    assert main(["--input", str(src), "--output", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "2 ids appear on more than one row" in err and "'a' on lines 1, 3" in err and "'b' on lines 2, 4" in err
    assert not out.exists(), "nothing may be written when ids repeat"
    assert time.perf_counter() - t0 < 30, "refused before loading a model"
    with pytest.raises(DuplicateIds):
        run_job(str(src), str(out), backend=None)


def test_a_half_written_last_line_is_cut_before_resuming(tmp_path):
    out = tmp_path / "out.jsonl"
    whole = json.dumps({"id": "batch_req_1", "custom_id": "a", "response": None, "error": {"code": "x", "message": ""}})
    out.write_text(whole + "\n" + '{"id": "batch_req_2", "custom_id": "b", "resp')
    assert read_done(str(out)) == {"a"}
    assert out.read_text() == whole + "\n"


# ---- the bundled model ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rows_file(tmp_path_factory) -> tuple[Path, list[str], dict[str, str]]:
    lines, bad = make_rows(200)
    path = tmp_path_factory.mktemp("batch") / "requests.jsonl"
    path.write_text("\n".join(lines) + "\n\n")  # a trailing blank line is not a row
    return path, lines, bad


@pytest.mark.slow
def test_200_rows_in_process_give_200_rows_with_ids_matched(rows_file, tmp_path, capsys):
    path, lines, bad = rows_file
    out = tmp_path / "results.jsonl"
    summary_file = tmp_path / "summary.json"
    # The command line's own entry point, in this process: the engine is built from its options.
    assert main(["--input", str(path), "--output", str(out), "--no-progress", "--summary-json", str(summary_file),
                 *ENGINE_ARGS]) == 0
    rows = check_results(lines, bad, out)
    summary = json.loads(summary_file.read_text())
    assert (summary["rows_total"], summary["rows_ok"], summary["rows_failed"], summary["rows_skipped"]) == \
        (200, 190, 10, 0)
    assert summary["completion_tokens"] == sum(r["response"]["body"]["usage"]["completion_tokens"]
                                               for r in rows.values() if r["response"])
    assert "190 ok, 10 failed" in capsys.readouterr().err
    # The prompt-too-long and invalid-regex rows say why.
    assert "max_model_len is 512" in rows["row-40"]["error"]["message"]
    assert "structured_outputs.regex is invalid" in rows["row-80"]["error"]["message"]
    assert rows["row-10"]["response"]["body"]["model"] == "SmolLM2-135M-Instruct"


CHAT_QUESTION = [{"role": "user", "content": "Name one colour."}]
LOGPROB_ROWS = [
    {"custom_id": "lp-chat", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": CHAT_QUESTION, "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 3,
        "prompt_logprobs": 2}},
    {"custom_id": "lp-chat-0", "method": "POST", "url": "/v1/chat/completions", "body": {
        "messages": CHAT_QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": True}},
    {"custom_id": "lp-cmpl", "method": "POST", "url": "/v1/completions", "body": {
        "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "logprobs": 2,
        "prompt_logprobs": 1}},
    {"custom_id": "lp-too-many", "method": "POST", "url": "/v1/completions", "body": {
        "prompt": "x", "logprobs": 21}},
    {"id": "lp-plain", "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0, "n": 2, "logprobs": 0},
    # An evaluation harness's loglikelihood request: the prompt scored, nothing generated.
    {"custom_id": "lp-echo", "method": "POST", "url": "/v1/completions", "body": {
        "prompt": "The capital of France is Paris", "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}},
]
ECHO_IDS_TEXT = "Deux et deux font quatre, café"  # its token ids make the lp-echo-ids row


def echo_ids_row(tokenizer) -> dict:
    return {"custom_id": "lp-echo-ids", "method": "POST", "url": "/v1/completions", "body": {
        "prompt": tokenizer.encode(ECHO_IDS_TEXT), "max_tokens": 3, "echo": True, "logprobs": 2, "temperature": 0,
        "prompt_logprobs": 1}}


@pytest.fixture(scope="module")
def logprob_job(tmp_path_factory, bundled_dir):
    """The logprob rows run in process on an ``LLM``'s engine (as the stack's: float32, 512 tokens),
    with that ``LLM`` to compare against."""
    from engine_service.batch_backends import LocalBackend
    from engine_service.llm import LLM

    llm = LLM(bundled_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 << 20)
    folder = tmp_path_factory.mktemp("logprobs")
    src, out = folder / "in.jsonl", folder / "out.jsonl"
    rows = [*LOGPROB_ROWS, echo_ids_row(llm.get_tokenizer())]
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = run_job(str(src), str(out), LocalBackend(llm.llm_engine), progress=False)
    assert (summary.rows_ok, summary.rows_failed) == (6, 1)
    for line in out.read_text().splitlines():
        strict_json(line)
    return llm, src, output_rows(out)


def strict_json(line: str):
    def refuse(name):
        raise AssertionError(f"{name} is not JSON")
    return json.loads(line, parse_constant=refuse)


@pytest.mark.slow
def test_logprob_rows_in_process_give_what_generate_gives(logprob_job):
    """Each row's logprobs, in its endpoint's shape, are the engine's: the tokens' own texts, their
    logprobs and ranks, the top k; prompt_logprobs position by position."""
    from engine_service.batch_backends import apply_chat_template
    from engine_service.sampling_params import SamplingParams

    llm, _, rows = logprob_job
    tok = llm.get_tokenizer()

    def texts(ids):
        return [tok.convert_tokens_to_string([t]) for t in tok.convert_ids_to_tokens(ids)]

    def ranked(entry: dict, k: int):
        return sorted(entry.items(), key=lambda kv: kv[1].rank)[:k]

    # completions: logprobs 2, prompt_logprobs 1
    want = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=2,
                                                                   prompt_logprobs=1), use_tqdm=False)[0]
    c = want.outputs[0]
    choice = rows["lp-cmpl"]["response"]["body"]["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == c.text and lp["tokens"] == texts(c.token_ids) and "".join(lp["tokens"]) == c.text
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(c.token_ids))]
    assert lp["token_logprobs"] == pytest.approx([e[t].logprob for t, e in zip(c.token_ids, c.logprobs)], abs=1e-6)
    for top, token, entry in zip(lp["top_logprobs"], c.token_ids, c.logprobs):
        expected = {lp.decoded_token: lp.logprob for _, lp in ranked(entry, 2)}
        expected.setdefault(entry[token].decoded_token, entry[token].logprob)
        assert top == pytest.approx(expected, abs=1e-6)
    prompt = choice["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == len(want.prompt_token_ids)
    for got, target, entry in zip(prompt[1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
        assert list(got) == [str(t) for t in entry] and str(target) in got
        assert [(g["rank"], g["decoded_token"]) for g in got.values()] == [(e.rank, e.decoded_token) for e in entry.values()]
        assert [g["logprob"] for g in got.values()] == pytest.approx([max(e.logprob, -9999) for e in entry.values()])

    # chat: logprobs true, top_logprobs 3, prompt_logprobs 2 (on the body)
    ids = apply_chat_template(tok, CHAT_QUESTION)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=5, logprobs=3,
                                                                  prompt_logprobs=2), use_tqdm=False)[0]
    c = want.outputs[0]
    body = rows["lp-chat"]["response"]["body"]
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["message"]["content"] == c.text == "".join(x["token"] for x in content)
    for x, token, entry in zip(content, c.token_ids, c.logprobs, strict=True):
        assert x["token"] == entry[token].decoded_token and x["bytes"] == list(x["token"].encode())
        assert x["logprob"] == pytest.approx(entry[token].logprob, abs=1e-6)
        assert [(t["token"], t["logprob"]) for t in x["top_logprobs"]] == \
            [(e.decoded_token, pytest.approx(e.logprob, abs=1e-6)) for _, e in ranked(entry, 3)]
        assert x["top_logprobs"][0]["token"] == x["token"], "greedy: the sampled token is the top one"
    assert len(body["prompt_logprobs"]) == len(ids) == body["usage"]["prompt_tokens"]
    assert all(len(e) in (2, 3) for e in body["prompt_logprobs"][1:])
    assert all(x["top_logprobs"] == [] for x in rows["lp-chat-0"]["response"]["body"]["choices"][0]["logprobs"]["content"])

    # n = 2, logprobs 0 (plain form: completions)
    choices = rows["lp-plain"]["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    for choice in choices:
        assert len(choice["logprobs"]["tokens"]) == 4 and all(len(t) == 1 for t in choice["logprobs"]["top_logprobs"])
    assert "max_logprobs" in rows["lp-too-many"]["error"]["message"]

    # echo, max_tokens 0: the prompt's text and its tokens' logprobs (the first null), nothing generated
    prompt = "The capital of France is Paris"
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    body = rows["lp-echo"]["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"] == texts(want.prompt_token_ids) and "".join(lp["tokens"]) == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:] == pytest.approx(
        [e[t].logprob for t, e in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:])], abs=1e-6)
    for top, token, entry in zip(lp["top_logprobs"][1:], want.prompt_token_ids[1:], want.prompt_logprobs[1:]):
        expected = {e.decoded_token: e.logprob for _, e in ranked(entry, 1)}
        expected.setdefault(entry[token].decoded_token, entry[token].logprob)
        assert top == pytest.approx(expected, abs=1e-6)
    assert "prompt_logprobs" not in choice, "echo asks the engine for prompt logprobs; the row did not"

    # echo of a token-id prompt (decoded here) before 3 generated tokens, logprobs 2; prompt_logprobs 1 too
    ids = tok.encode(ECHO_IDS_TEXT)
    want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                                  prompt_logprobs=2), use_tqdm=False)[0]
    c = want.outputs[0]
    choice = rows["lp-echo-ids"]["response"]["body"]["choices"][0]
    assert choice["text"] == ECHO_IDS_TEXT + c.text
    lp = choice["logprobs"]
    assert lp["tokens"] == texts(ids) + texts(c.token_ids)
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["token_logprobs"][len(ids):] == pytest.approx([e[t].logprob for t, e in zip(c.token_ids, c.logprobs)],
                                                            abs=1e-6)
    assert all(len(t) in (2, 3) for t in lp["top_logprobs"][1:])
    assert all(len(e) in (1, 2) for e in choice["prompt_logprobs"][1:]), "the row's prompt_logprobs 1, not echo's 2"


def compare_logprob_rows(got: dict[str, dict], want: dict[str, dict]) -> None:
    """Rows of the logprob job through gRPC against the in-process ones: the same texts, tokens and
    top tokens; logprobs equal to float32 precision."""
    assert sorted(got) == sorted(want)
    assert got["lp-too-many"]["error"]["code"] == "invalid_request"
    assert "max_logprobs" in got["lp-too-many"]["error"]["message"]
    for key in ("lp-chat", "lp-chat-0", "lp-cmpl", "lp-plain", "lp-echo", "lp-echo-ids"):
        g, w = got[key]["response"]["body"], want[key]["response"]["body"]
        assert g["usage"] == w["usage"], key
        for gc, wc in zip(g["choices"], w["choices"], strict=True):
            glp, wlp = gc["logprobs"], wc["logprobs"]
            if "content" in wlp:
                assert [x["token"] for x in glp["content"]] == [x["token"] for x in wlp["content"]]
                assert [[t["token"] for t in x["top_logprobs"]] for x in glp["content"]] == \
                    [[t["token"] for t in x["top_logprobs"]] for x in wlp["content"]]
                assert [x["logprob"] for x in glp["content"]] == pytest.approx([x["logprob"] for x in wlp["content"]],
                                                                               abs=1e-4)
            else:
                assert (gc["text"], glp["tokens"], glp["text_offset"]) == (wc["text"], wlp["tokens"], wlp["text_offset"])
                assert [t and list(t) for t in glp["top_logprobs"]] == [t and list(t) for t in wlp["top_logprobs"]]
                assert glp["token_logprobs"] == pytest.approx(wlp["token_logprobs"], abs=1e-4)
        gp = g.get("prompt_logprobs") or g["choices"][0].get("prompt_logprobs")
        wp = w.get("prompt_logprobs") or w["choices"][0].get("prompt_logprobs")
        assert (gp is None) == (wp is None), key
        if wp is not None:
            assert gp[0] is None and [list(e) for e in gp[1:]] == [list(e) for e in wp[1:]]
            assert [e[k]["logprob"] for e in gp[1:] for k in e] == \
                pytest.approx([e[k]["logprob"] for e in wp[1:] for k in e], abs=1e-4)


def wait_for_rows(path: Path, count: int, proc: subprocess.Popen, timeout: float = 300) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the job ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}"
        n = path.read_text().count("\n") if path.exists() else 0
        if n >= count:
            return n
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} rows after {timeout} s")


def batch_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "engine_service.batch", "--no-progress", *args]


def kill_then_resume(path: Path, out: Path, lines: list[str], bad: dict[str, str], args: list[str],
                     first_run_args: list[str], kill_after: int) -> None:
    """Run the job as a subprocess (with ``first_run_args`` too), SIGKILL it once ``kill_after`` rows are
    out, resume, check each id once."""
    proc = subprocess.Popen(batch_command("--input", str(path), "--output", str(out), *args, *first_run_args), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_rows(out, kill_after, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
    written = len(out.read_text().splitlines())
    assert kill_after <= written < 200, f"the kill came too late to test resuming ({written} rows)"
    resumed = subprocess.run(batch_command("--input", str(path), "--output", str(out), *args), cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    m = re.search(r"(\d+) rows \((\d+) ok, (\d+) failed\), (\d+) already done, 200 in the input", resumed.stderr)
    assert m, resumed.stderr[-2000:]
    done_now, skipped = int(m.group(1)), int(m.group(4))
    assert skipped >= written - 1 and done_now + skipped == 200, resumed.stderr[-2000:]
    check_results(lines, bad, out)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, bundled_dir):
    """A Pagoda cluster: a private redis-server, one engine service and one router (subprocesses)."""
    from tests.fleet import RedisServer, start_engine, start_router, wait_engines, wait_serving

    logs = tmp_path_factory.mktemp("batch-stack")
    redis_server = RedisServer(logs)
    procs = []
    try:
        engine = start_engine("batch-e1", "bundled", redis_server.url, logs, *ENGINE_ARGS, "--max-num-seqs", "16")
        procs.append(engine)
        router = start_router("batch-r1", redis_server.url, logs)
        procs.append(router)
        client = redis_server.client()
        wait_engines(client, {"batch-e1"}, [engine])
        client.close()
        wait_serving(router)
        yield {"engine": engine.target, "router": router.target}
    finally:
        for p in procs:
            p.stop()
        redis_server.stop()


@pytest.mark.slow
def test_200_rows_through_a_router_and_engine_killed_half_way_then_resumed(rows_file, stack, tmp_path):
    """Through a router + engine stack: the job's client is killed with SIGKILL while its streams are
    open (the router aborts them on the engine); the re-run, a new client, finishes the job: 200
    rows, each id once, bad rows as error rows."""
    path, lines, bad = rows_file
    out = tmp_path / "results.jsonl"
    kill_then_resume(path, out, lines, bad, ["--router", stack["router"]], ["--concurrency", "8"], kill_after=60)
    rows = output_rows(out)
    assert rows["row-10"]["response"]["body"]["model"] == "SmolLM2-135M-Instruct"
    assert "max_model_len is 512" in rows["row-40"]["error"]["message"]


@pytest.mark.slow
def test_rows_straight_to_an_engine_service(rows_file, stack, tmp_path):
    """``--engine HOST:PORT`` (no router): the first 40 rows, one output row each, ids matched."""
    path, lines, bad = rows_file
    subset_lines = lines[:41]
    subset = tmp_path / "subset.jsonl"
    subset.write_text("\n".join(subset_lines) + "\n")
    out = tmp_path / "results.jsonl"
    done = subprocess.run(batch_command("--input", str(subset), "--output", str(out), "--engine", stack["engine"],
                                        "--concurrency", "8"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    keys = set(input_keys(subset_lines))
    rows = check_results(subset_lines, {k: v for k, v in bad.items() if k in keys}, out)
    assert "max_model_len is 512" in rows["row-40"]["error"]["message"]


@pytest.mark.slow
@pytest.mark.parametrize("through", ["router", "engine"])
def test_logprob_rows_through_grpc_match_in_process(logprob_job, stack, tmp_path, through):
    """The logprob rows through a router or straight to an engine service: token texts come over
    gRPC (TokenLogprob.token), so the rows read as the in-process job's."""
    llm, src, want = logprob_job
    out = tmp_path / "results.jsonl"
    command = batch_command("--input", str(src), "--output", str(out), f"--{through}", stack[through])
    if through == "router":
        # Echo rows with logprobs or token ids need the tokenizer on this side: without it they fail, alone.
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rows = output_rows(out)
        for key in ("lp-echo", "lp-echo-ids"):
            assert "need the model's tokenizer here (--tokenizer DIR)" in rows[key]["error"]["message"]
        assert rows["lp-cmpl"]["error"] is None
        out.unlink()
        command += ["--tokenizer", llm.llm_engine.model_dir]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for line in out.read_text().splitlines():
        strict_json(line)
    compare_logprob_rows(output_rows(out), want)
