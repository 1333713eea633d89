"""Batch-job rows: the OpenAI batch-file JSONL (and a plain form) in, OpenAI batch output rows out.

Input rows, one JSON object per line:

- OpenAI batch form: ``{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
  "body": {"messages": [...], "max_tokens": 64, ...}}`` (or ``"url": "/v1/completions"`` with
  ``"prompt"``);
- plain form: ``{"id": "r1", "prompt": "..."}`` or ``{"id": "r1", "messages": [...]}``, sampling
  fields (``max_tokens``, ``temperature``, ...) beside them.

A row that cannot be run (malformed JSON, an unknown or unsupported field, a bad value) becomes an
error row naming the field; it never stops the job. Output rows follow OpenAI's batch output:
``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body": <chat.completion or
text_completion>}, "error": null}`` or ``{"id", "custom_id", "response": null, "error": {"code",
"message"}}``.

Logprobs take OpenAI's two shapes: a chat row asks ``"logprobs": true`` (and ``"top_logprobs": k``)
and gets ``choices[i].logprobs.content``, one ``{"token", "logprob", "bytes", "top_logprobs"}`` per
token; a completions row asks ``"logprobs": k`` and gets ``{"tokens", "token_logprobs",
"top_logprobs", "text_offset"}``, each ``top_logprobs`` item holding the top k and the sampled
token. vLLM's ``"prompt_logprobs": k`` (scoring a prompt) gives its list, ``null`` for the first
prompt token then ``{token id: {"logprob", "rank", "decoded_token"}}``, on each completions choice
or on a chat body. JSON has no -Infinity: a logprob below -9999 is written as -9999, as vLLM does.
A completions row with ``"echo": true`` gets the prompt's text before the completion's and, with
``logprobs``, the prompt tokens' logprobs before the completion's (the first prompt token's null);
``"max_tokens": 0`` with echo returns the prompt alone: how an evaluation harness scores a
continuation's loglikelihood through the completions API.
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

from engine_service.sampling_params import SamplingParams

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
# What a completions request gets without max_tokens (OpenAI's and vLLM's default); chat: up to max_model_len.
DEFAULT_COMPLETION_MAX_TOKENS = 16

# Request-body fields and the SamplingParams field each maps to (vLLM's extra sampling fields included).
_SAMPLING_FIELDS = {
    "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens", "temperature": "temperature",
    "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens", "ignore_eos": "ignore_eos",
    "stop_token_ids": "stop_token_ids", "skip_special_tokens": "skip_special_tokens",
    "include_stop_str_in_output": "include_stop_str_in_output", "structured_outputs": "structured_outputs",
    "allowed_token_ids": "allowed_token_ids", "truncate_prompt_tokens": "truncate_prompt_tokens",
    "bad_words": "bad_words",
}
# Logprob fields, read by hand: their type differs by endpoint (chat: logprobs true + top_logprobs k;
# completions: logprobs k); prompt_logprobs is vLLM's, on both.
_LOGPROB_FIELDS = {"chat": {"logprobs", "top_logprobs", "prompt_logprobs"},
                   "completions": {"logprobs", "prompt_logprobs", "echo"}}
# JSON has no -Infinity; vLLM writes logprobs below this as this.
MIN_LOGPROB = -9999.0
# Accepted and without effect here.
_IGNORED_FIELDS = {"model", "user", "stream", "metadata", "store", "service_tier"}
_OPENAI_KEYS = {"custom_id", "method", "url", "body"}


class RowError(Exception):
    """A row that cannot run; becomes an error row with ``code`` and the message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass
class BatchRequest:
    """One input row, ready to submit."""

    key: str                       # unique within the job: custom_id, or "line:N" when the row has none
    custom_id: str | None
    line: int                      # 1-based line number in the input file
    endpoint: str                  # "chat" or "completions"
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    model: str | None = None
    echo: bool = False             # completions: the prompt's text (and logprobs) before the completion's
    prompt_only: bool = False      # echo with max_tokens 0: the prompt alone (one token is run, not written)
    prompt_logprobs: int | None = None  # what the row asked (echo may ask the engine for more)


class TokenLogprob(NamedTuple):
    token_id: int
    token: str                     # its text on its own (Logprob.decoded_token)
    logprob: float
    rank: int | None


class PositionLogprobs(NamedTuple):
    """One position: its token (sampled, or the prompt's) and the top k by rank."""

    token: TokenLogprob
    top: list[TokenLogprob]


@dataclass
class Choice:
    index: int
    text: str
    finish_reason: str | None      # "stop" | "length" | "abort"
    num_tokens: int
    logprobs: list[PositionLogprobs] | None = None  # one per token, when the row asked


@dataclass
class BatchResult:
    """What a backend hands back for one request."""

    request_id: str
    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int = field(default=0)
    cached_prompt_tokens: int = 0
    # When the row asked prompt_logprobs: None for the first prompt token, then one per token.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Echo rows: the prompt's text, and its first token's (whose logprob is null) when logprobs are asked.
    prompt_text: str | None = None
    first_prompt_token: str | None = None


def row_key(obj, line: int) -> str:
    """The row's id for duplicate detection and resume: custom_id (or plain ``id``), else "line:N"."""
    if isinstance(obj, dict):
        rid = obj.get("custom_id") if _is_openai(obj) else obj.get("id")
        if isinstance(rid, (str, int)) and not isinstance(rid, bool) and str(rid) != "":
            return str(rid)
    return f"line:{line}"


def _is_openai(obj: dict) -> bool:
    return "custom_id" in obj or "url" in obj or "body" in obj


def parse_row(text: str, line: int) -> BatchRequest:
    """One input line as a ``BatchRequest``; RowError (code, message naming the field) otherwise."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise RowError("invalid_json", f"line {line} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise RowError("invalid_request", f"line {line} must be a JSON object, got {type(obj).__name__}")
    key = row_key(obj, line)
    if _is_openai(obj):
        return _parse_openai(obj, key, line)
    return _parse_plain(obj, key, line)


def _parse_openai(obj: dict, key: str, line: int) -> BatchRequest:
    unknown = sorted(set(obj) - _OPENAI_KEYS)
    if unknown:
        raise RowError("invalid_request", f"unknown field {unknown[0]!r} (an OpenAI batch row has "
                                          "custom_id, method, url, body)")
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise RowError("invalid_request", f"custom_id must be a non-empty string, got {custom_id!r}")
    method = obj.get("method", "POST")
    if method != "POST":
        raise RowError("invalid_request", f"method must be 'POST', got {method!r}")
    url = obj.get("url")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise RowError("invalid_request", f"url must be {CHAT_URL!r} or {COMPLETIONS_URL!r}, got {url!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise RowError("invalid_request", f"body must be a JSON object, got {type(body).__name__}")
    endpoint = "chat" if url == CHAT_URL else "completions"
    return _build(body, key, custom_id, line, endpoint, "body.")


def _parse_plain(obj: dict, key: str, line: int) -> BatchRequest:
    if "id" not in obj:
        raise RowError("invalid_request", "a plain row needs an 'id' (or use the OpenAI form with custom_id)")
    if key.startswith("line:"):
        raise RowError("invalid_request", f"id must be a non-empty string or an integer, got {obj['id']!r}")
    body = {k: v for k, v in obj.items() if k != "id"}
    endpoint = "chat" if "messages" in body else "completions"
    return _build(body, key, key, line, endpoint, "")


def _build(body: dict, key: str, custom_id: str, line: int, endpoint: str, where: str) -> BatchRequest:
    input_field = "messages" if endpoint == "chat" else "prompt"
    allowed = ({input_field, "response_format", "logit_bias"} | set(_SAMPLING_FIELDS) | _IGNORED_FIELDS
               | _LOGPROB_FIELDS[endpoint])
    for name in body:
        if name not in allowed:
            other = "prompt" if input_field == "messages" else "messages"
            hint = (f" ({other!r} belongs to the other endpoint)" if name == other
                    else " (not supported by the batch job)")
            raise RowError("invalid_request", f"unsupported field {where}{name}{hint}")
    if body.get("stream"):
        raise RowError("invalid_request", f"{where}stream must be false in a batch job")
    if input_field not in body:
        raise RowError("invalid_request", f"{where}{input_field} is missing")
    prompt = messages = None
    if endpoint == "chat":
        messages = _check_messages(body["messages"], where)
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
            raise RowError("invalid_request", f"{where}prompt must be a string or a list of token ids "
                                              "(one prompt per row)")
    kwargs = {}
    for name, value in body.items():
        target = _SAMPLING_FIELDS.get(name)
        if target is not None and value is not None:
            kwargs[target] = value
    if "max_tokens" not in kwargs:
        kwargs["max_tokens"] = DEFAULT_COMPLETION_MAX_TOKENS if endpoint == "completions" else None
    kwargs.update(_logprob_params(body, endpoint, where))
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _logit_bias(body["logit_bias"], where)
    asked_prompt_logprobs = kwargs.get("prompt_logprobs")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise RowError("invalid_request", f"{where}echo must be true or false, got {echo!r}")
    if echo and kwargs.get("truncate_prompt_tokens") is not None:
        raise RowError("invalid_request", f"{where}echo and {where}truncate_prompt_tokens cannot be used together "
                                          "(the echoed prompt would not be the one scored)")
    prompt_only = echo and kwargs.get("max_tokens") == 0
    if endpoint == "completions" and not echo and kwargs.get("max_tokens") == 0:
        raise RowError("invalid_request", f"{where}max_tokens must be >= 1 (0 only with {where}echo: true)")
    if prompt_only:
        kwargs["max_tokens"] = 1
    if echo and kwargs.get("logprobs") is not None:  # the prompt's logprobs come first in the choice's
        kwargs["prompt_logprobs"] = max(asked_prompt_logprobs or 0, kwargs["logprobs"])
    if body.get("response_format") is not None:
        if "structured_outputs" in kwargs:
            raise RowError("invalid_request", f"{where}response_format and {where}structured_outputs are "
                                              "mutually exclusive")
        structured = response_format_to_structured_outputs(body["response_format"], where)
        if structured is not None:
            kwargs["structured_outputs"] = structured
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as e:
        raise RowError("invalid_request", f"{where.rstrip('.') or 'row'}: {e}") from None
    model = body.get("model") if isinstance(body.get("model"), str) else None
    return BatchRequest(key, custom_id, line, endpoint, params, prompt, messages, model, echo, prompt_only,
                        asked_prompt_logprobs)


def _logit_bias(value, where: str) -> dict[int, float]:
    """OpenAI's ``logit_bias``: token ids (JSON object keys, so strings) to biases in [-100, 100]."""
    name = f"{where}logit_bias"
    if not isinstance(value, dict):
        raise RowError("invalid_request", f"{name} must be an object of token id to bias, got {type(value).__name__}")
    result = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except ValueError:
            raise RowError("invalid_request", f"{name} keys must be token ids, got {key!r}") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise RowError("invalid_request", f"{name}[{key!r}] must be a number in [-100, 100], got {bias!r}")
        result[token] = float(bias)
    return result


def _logprob_params(body: dict, endpoint: str, where: str) -> dict:
    """SamplingParams' ``logprobs`` / ``prompt_logprobs`` from the row's fields (the limit,
    ``max_logprobs``, is the engine's to check)."""
    def count(name: str) -> int | None:
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise RowError("invalid_request", f"{where}{name} must be an integer >= 0, got {value!r}")
        return value

    kwargs = {}
    if endpoint == "chat":
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise RowError("invalid_request", f"{where}logprobs must be true or false on {CHAT_URL} "
                                              f"({where}top_logprobs says how many alternatives), got {wanted!r}")
        top = count("top_logprobs")
        if top is not None and not wanted:
            raise RowError("invalid_request", f"{where}top_logprobs needs {where}logprobs: true")
        if wanted:
            kwargs["logprobs"] = top or 0
    elif count("logprobs") is not None:
        kwargs["logprobs"] = body["logprobs"]
    if count("prompt_logprobs") is not None:
        kwargs["prompt_logprobs"] = body["prompt_logprobs"]
    return kwargs


def _check_messages(messages, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise RowError("invalid_request", f"{where}messages must be a non-empty list")
    result = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RowError("invalid_request", f"{where}messages[{i}] must be an object with a 'role'")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                raise RowError("invalid_request", f"{where}messages[{i}].content: only text parts are supported")
            content = "".join(p.get("text", "") for p in content)
        if not isinstance(content, str):
            raise RowError("invalid_request", f"{where}messages[{i}].content must be a string")
        result.append({"role": m["role"], "content": content})
    return result


def response_format_to_structured_outputs(fmt, where: str = "body.") -> dict | None:
    """OpenAI's ``response_format`` as ``structured_outputs`` (None for plain text)."""
    name = f"{where}response_format"
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise RowError("invalid_request", f"{name} must be an object with a 'type'")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
            raise RowError("invalid_request", f"{name}.json_schema.schema must be a JSON schema object")
        return {"json": spec["schema"]}
    raise RowError("invalid_request", f"{name}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


# ---- output rows ----------------------------------------------------------------------------------

def _row_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def success_row(req: BatchRequest, result: BatchResult, model: str) -> dict:
    """The OpenAI batch output row for a completed request (a chat.completion or text_completion body)."""
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        k = req.prompt_logprobs
        prompt_logprobs = [None if p is None else _prompt_logprob_entry(p, k) for p in result.prompt_logprobs or []]
    completion_tokens = 0 if req.prompt_only else result.completion_tokens
    if req.endpoint == "chat":
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
                    "finish_reason": c.finish_reason} for c in result.choices]
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion"}
    else:
        choices = [_completion_choice(req, result, c) for c in result.choices]
        if prompt_logprobs is not None:
            for choice in choices:
                choice["prompt_logprobs"] = prompt_logprobs
        body = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion"}
    body.update(created=int(time.time()), model=req.model or model, choices=choices, usage={
        "prompt_tokens": result.prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": result.prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_prompt_tokens}})
    if req.endpoint == "chat" and prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    row = {"id": _row_id(), "custom_id": req.custom_id,
           "response": {"status_code": 200, "request_id": result.request_id, "body": body}, "error": None}
    return _with_line(row, req.key, req.line)


def _completion_choice(req: BatchRequest, result: BatchResult, c: Choice) -> dict:
    """A text_completion choice; with echo, the prompt's text and logprobs come first (the first
    prompt token's logprob and top_logprobs null, as OpenAI and vLLM write them)."""
    if not req.echo:
        return {"index": c.index, "text": c.text,
                "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs),
                "finish_reason": c.finish_reason}
    generated = [] if req.prompt_only else c.logprobs
    logprobs = None
    if c.logprobs is not None:
        logprobs = completion_logprobs(result.prompt_logprobs[1:] + generated, first_token=result.first_prompt_token,
                                       k=req.params.logprobs)
    return {"index": c.index, "text": result.prompt_text + ("" if req.prompt_only else c.text),
            "logprobs": logprobs, "finish_reason": "length" if req.prompt_only else c.finish_reason}


def _clamped(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def chat_logprobs(positions: list[PositionLogprobs]) -> dict:
    """A chat choice's ``logprobs``: per token its text, logprob, UTF-8 bytes and the top k."""
    def item(t: TokenLogprob) -> dict:
        return {"token": t.token, "logprob": _clamped(t.logprob), "bytes": list(t.token.encode())}

    return {"content": [{**item(p.token), "top_logprobs": [item(t) for t in p.top]} for p in positions],
            "refusal": None}


def completion_logprobs(positions: list[PositionLogprobs], first_token: str | None = None,
                        k: int | None = None) -> dict:
    """A completions choice's ``logprobs``: tokens, their logprobs, each position's top k with the
    sampled token ({text: logprob}), and each token's offset in the choice's text. ``first_token``
    (echo) leads with a token that has no logprob; ``k`` cuts longer top lists (an echoed prompt's
    may hold more)."""
    tokens = [p.token.token for p in positions]
    values = [_clamped(p.token.logprob) for p in positions]
    tops = []
    for p in positions:
        top = {t.token: _clamped(t.logprob) for t in p.top[:k]}
        top.setdefault(p.token.token, _clamped(p.token.logprob))
        tops.append(top)
    if first_token is not None:
        tokens, values, tops = [first_token, *tokens], [None, *values], [None, *tops]
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": list(itertools.accumulate(map(len, tokens[:-1]), initial=0)) if tokens else []}


def _prompt_logprob_entry(p: PositionLogprobs, k: int) -> dict:
    def item(t: TokenLogprob) -> dict:
        return {"logprob": _clamped(t.logprob), "rank": t.rank, "decoded_token": t.token}

    entry = {str(t.token_id): item(t) for t in p.top[:k]}
    entry.setdefault(str(p.token.token_id), item(p.token))
    return entry


def error_row(key: str, custom_id: str | None, line: int, code: str, message: str) -> dict:
    row = {"id": _row_id(), "custom_id": custom_id, "response": None, "error": {"code": code, "message": message}}
    return _with_line(row, key, line)


def _with_line(row: dict, key: str, line: int) -> dict:
    # A row without a usable id is known by its line number (so that a re-run can skip it).
    if key.startswith("line:"):
        row["line"] = line
    return row


def output_key(row: dict) -> str | None:
    """The input key an output row answers (None if the row is not one of ours)."""
    if not isinstance(row, dict):
        return None
    if row.get("custom_id") is not None:
        return str(row["custom_id"])
    if isinstance(row.get("line"), int):
        return f"line:{row['line']}"
    return None
