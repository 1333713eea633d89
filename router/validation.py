"""Checks a ``GenerateRequest`` before it queues and turns it into the engine's request.

Every refusal is a ``ValueError`` whose message starts with the field's name and states the rule
(the router answers INVALID_ARGUMENT with it). The sampling ranges are vLLM's, the same as
``engine_service.SamplingParams`` (tests check that both refuse the same values); the limits that
depend on the model (``max_model_len``, vocabulary, ``max_logprobs``) come from the engines'
registry records. What this misses the engine still refuses, and the router relays that refusal
as INVALID_ARGUMENT without counting it against the engine.
"""
from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from pagoda.v1 import common_pb2, engine_pb2, router_pb2
from router.tokenizer import PromptTokenizer

_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class Limits:
    """Request limits of one router (model limits come from the registry)."""

    max_priority: int = 100
    max_n: int = 16
    max_stop: int = 16
    max_stop_chars: int = 256
    max_stop_token_ids: int = 64
    max_logit_bias: int = 300  # OpenAI's limit on logit_bias entries
    max_bad_words: int = 64
    max_messages: int = 256
    affinity_prefix_tokens: int = 64
    """Prompts sharing their first this-many tokens (rounded down to whole KV blocks) share an affinity key."""

    def __post_init__(self):
        for name in ("max_priority", "max_n", "max_stop", "max_stop_chars", "max_stop_token_ids", "max_logit_bias",
                     "max_bad_words", "max_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.affinity_prefix_tokens < 0:
            raise ValueError(f"affinity_prefix_tokens must be >= 0, got {self.affinity_prefix_tokens}")


@dataclass(frozen=True)
class ModelLimits:
    """What the engines serving a model accept (the tightest figures over its live engines)."""

    model: str
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    block_size: int


@dataclass(frozen=True)
class ValidRequest:
    request_id: str
    priority: int
    prompt_token_ids: list[int]
    engine_request: engine_pb2.EngineGenerateRequest
    prefix_key: str
    """Key of the prompt's leading whole KV blocks ('' if it has none): prefix-cache affinity."""


def _check_sampling(p: common_pb2.SamplingParams, limits: Limits, model: ModelLimits) -> None:
    def fail(name: str, rule: str, value=None) -> None:
        value = getattr(p, name) if value is None else value
        raise ValueError(f"sampling.{name} must be {rule}, got {value!r}")

    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if not math.isfinite(getattr(p, name)):
            fail(name, "a finite number")
    if p.HasField("n") and not 1 <= p.n <= limits.max_n:
        fail("n", f"in [1, {limits.max_n}]")
    if p.HasField("temperature") and p.temperature < 0:
        fail("temperature", ">= 0")
    if p.HasField("top_p") and not 0 < p.top_p <= 1:
        fail("top_p", "in (0, 1]")
    if p.top_k < -1:
        fail("top_k", "-1 or 0 (all tokens), or >= 1")
    if not 0 <= p.min_p <= 1:
        fail("min_p", "in [0, 1]")
    if not -2 <= p.presence_penalty <= 2:
        fail("presence_penalty", "in [-2, 2]")
    if not -2 <= p.frequency_penalty <= 2:
        fail("frequency_penalty", "in [-2, 2]")
    if p.HasField("repetition_penalty") and not p.repetition_penalty > 0:
        fail("repetition_penalty", "> 0")
    if p.HasField("max_tokens") and p.max_tokens < 1:
        fail("max_tokens", ">= 1 (unset: up to max_model_len)")
    if p.HasField("max_tokens") and p.min_tokens > p.max_tokens:
        fail("min_tokens", f"<= max_tokens ({p.max_tokens})")
    if p.min_tokens >= model.max_model_len:
        fail("min_tokens", f"< max_model_len ({model.max_model_len})")
    if p.HasField("logprobs") and p.logprobs > model.max_logprobs:
        fail("logprobs", f"<= max_logprobs ({model.max_logprobs})")
    if p.HasField("prompt_logprobs") and p.prompt_logprobs > model.max_logprobs:
        fail("prompt_logprobs", f"<= max_logprobs ({model.max_logprobs})")
    if len(p.stop) > limits.max_stop:
        fail("stop", f"at most {limits.max_stop} strings", f"{len(p.stop)} strings")
    for s in p.stop:
        if not 0 < len(s) <= limits.max_stop_chars:
            fail("stop", f"non-empty strings of at most {limits.max_stop_chars} characters", s[:40])
    if len(p.stop_token_ids) > limits.max_stop_token_ids:
        fail("stop_token_ids", f"at most {limits.max_stop_token_ids} ids", f"{len(p.stop_token_ids)} ids")
    bad = [t for t in p.stop_token_ids if t >= model.vocab_size]
    if bad:
        fail("stop_token_ids", f"ids in the vocabulary [0, {model.vocab_size})", bad[0])
    if len(p.logit_bias) > limits.max_logit_bias:
        fail("logit_bias", f"at most {limits.max_logit_bias} entries", f"{len(p.logit_bias)} entries")
    bad = sorted(t for t in p.logit_bias if t >= model.vocab_size)
    if bad:
        fail("logit_bias", f"token ids in the vocabulary [0, {model.vocab_size})", bad[0])
    bad = [b for b in p.logit_bias.values() if math.isnan(b) or b == math.inf]
    if bad:
        fail("logit_bias", "biases that are numbers below +inf", bad[0])
    bad = [t for t in p.allowed_token_ids if t >= model.vocab_size]
    if bad:
        fail("allowed_token_ids", f"ids in the vocabulary [0, {model.vocab_size})", bad[0])
    if len(p.bad_words) > limits.max_bad_words:
        fail("bad_words", f"at most {limits.max_bad_words} words", f"{len(p.bad_words)} words")
    for w in p.bad_words:
        if not w.strip() or len(w) > limits.max_stop_chars:
            fail("bad_words", f"words that are not all whitespace, of at most {limits.max_stop_chars} characters",
                 w[:40])


def validate(request: router_pb2.GenerateRequest, tokenizer: PromptTokenizer, model: ModelLimits,
             limits: Limits, request_id: str) -> ValidRequest:
    """Check ``request`` for ``model`` and build the engine request (``request_id`` already chosen).

    Raises ValueError naming the first bad field and its rule.
    """
    if request.request_id and not _REQUEST_ID.fullmatch(request.request_id):
        raise ValueError("request_id must be 1 to 128 printable ASCII characters without spaces, "
                         f"got {request.request_id[:40]!r}")
    if not 0 <= request.priority <= limits.max_priority:
        raise ValueError(f"priority must be in [0, {limits.max_priority}] (higher goes first), got {request.priority}")
    which = request.WhichOneof("input")
    if which is None:
        raise ValueError("input is missing: set prompt, prompt_token_ids or messages")
    if which == "prompt":
        if not request.prompt:
            raise ValueError("prompt is empty: it must have at least 1 token")
        ids = tokenizer.encode(request.prompt)
        field = "prompt"
    elif which == "prompt_token_ids":
        ids = list(request.prompt_token_ids.ids)
        field = "prompt_token_ids"
        bad = [t for t in ids if t >= model.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[0]}, outside the vocabulary [0, {model.vocab_size})")
    else:
        messages = request.messages.messages
        field = "messages"
        if not messages:
            raise ValueError("messages is empty: send at least one message")
        if len(messages) > limits.max_messages:
            raise ValueError(f"messages has {len(messages)} entries; the limit is {limits.max_messages}")
        for i, m in enumerate(messages):
            if m.role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {m.role[:40]!r}")
        ids = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
    if not ids:
        raise ValueError(f"{field} is empty: it must have at least 1 token")
    ids = _truncated(ids, request.sampling, model)
    if len(ids) >= model.max_model_len:
        raise ValueError(f"{field} has {len(ids)} tokens, but max_model_len is {model.max_model_len}: "
                         f"the prompt must be at most {model.max_model_len - 1} tokens")
    _check_sampling(request.sampling, limits, model)
    engine_request = engine_pb2.EngineGenerateRequest(
        request_id=request_id, prompt_token_ids=engine_pb2.TokenIds(ids=ids), sampling_params=request.sampling,
        priority=request.priority)
    return ValidRequest(request_id=request_id, priority=request.priority, prompt_token_ids=ids,
                        engine_request=engine_request, prefix_key=prefix_key(ids, model.block_size,
                                                                             limits.affinity_prefix_tokens))


def _truncated(ids: list[int], p: common_pb2.SamplingParams, model: ModelLimits) -> list[int]:
    """The prompt's last ``sampling.truncate_prompt_tokens`` tokens, as the engine keeps them (so the
    length check, the affinity key and the engine see the same prompt)."""
    if not p.HasField("truncate_prompt_tokens"):
        return ids
    k = p.truncate_prompt_tokens
    if k == -1:
        k = model.max_model_len - 1
    if k < 1:
        raise ValueError(f"sampling.truncate_prompt_tokens must be an integer >= 1, or -1 for up to "
                         f"max_model_len - 1, got {p.truncate_prompt_tokens}")
    return ids[-k:] if len(ids) > k else ids


def prefix_key(ids: list[int], block_size: int, max_tokens: int) -> str:
    """A short key of the prompt's leading whole KV blocks (at most ``max_tokens`` tokens): prompts
    with the same key would hit the same prefix-cache blocks on an engine."""
    n = min(max_tokens, len(ids)) // block_size * block_size
    if n == 0:
        return ""
    return hashlib.blake2b(b"".join(t.to_bytes(4, "little") for t in ids[:n]), digest_size=12).hexdigest()
