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
from engine_service.batch_rows import RowError, parse_row

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


@pytest.mark.parametrize("row, message", [
    ('{"custom_id": "a", ', r"line 5 is not valid JSON"),
    ('[1, 2]', r"must be a JSON object"),
    ('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "logit_bias": {}}}',
     r"unsupported field body\.logit_bias"),
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
])
def test_bad_rows_become_row_errors_naming_the_field(row, message):
    with pytest.raises(RowError, match=message):
        parse_row(row, 5)


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
