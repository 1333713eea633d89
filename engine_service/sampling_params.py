"""Per-request sampling parameters, with vLLM's field names and meanings."""
from __future__ import annotations

import enum
import json as _json
import math
from dataclasses import dataclass, field, fields

# Temperatures below this are greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """A constraint on a completion's text, enforced by token masking (vLLM's names).

    Exactly one of: ``json`` (a JSON schema, as a dict or JSON text), ``regex``, ``choice`` (the
    output is one of these strings), ``grammar`` (EBNF / GBNF, or Lark), ``json_object`` (any JSON
    object). ``disable_any_whitespace`` makes JSON compact (no whitespace between tokens: fewer
    tokens to generate). The shape is checked here; whether the schema, regex or grammar itself is valid is
    checked when the engine compiles it at submission (``ValueError`` naming the field).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [name for name in self.KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("SamplingParams.structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {given or 'none'}")
        prefix = "SamplingParams.structured_outputs"
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    _json.loads(self.json)
                except ValueError as e:
                    raise ValueError(f"{prefix}.json is not valid JSON: {e}") from None
            elif not isinstance(self.json, (dict, bool)):
                raise ValueError(f"{prefix}.json must be a JSON schema (a dict or JSON text), "
                                 f"got {type(self.json).__name__}")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"{prefix}.regex must be a non-empty string, got {self.regex!r}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"{prefix}.grammar must be a non-empty string, got {self.grammar!r}")
        if self.choice is not None:
            if isinstance(self.choice, (str, bytes)) or not isinstance(self.choice, (list, tuple)):
                raise ValueError(f"{prefix}.choice must be a list of strings, got {self.choice!r}")
            self.choice = list(self.choice)
            if not self.choice or any(not isinstance(c, str) or not c for c in self.choice):
                raise ValueError(f"{prefix}.choice must be a non-empty list of non-empty strings, got {self.choice!r}")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"{prefix}.json_object must be True or None, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The name of the one field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in self.KINDS if getattr(self, name) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        if self.kind == "json" and not isinstance(value, str):
            value = _json.dumps(value, sort_keys=True)
        elif self.kind == "choice":
            value = _json.dumps(value)
        return self.kind + ("/compact" if self.disable_any_whitespace else ""), str(value)


class RequestOutputKind(enum.IntEnum):
    """What the engine hands out for a request at each step (vLLM's names and values).

    ``CUMULATIVE``: an output every step, ``text`` / ``token_ids`` / ``logprobs`` the whole
    completion so far (the ``delta_*`` fields this step's part). ``DELTA``: an output every step,
    holding only this step's part. ``FINAL_ONLY``: one output, when the request finishes, with the
    whole completion (``LLM.generate`` and ``LLM.chat`` ask for this: nothing is built for the steps
    in between).
    """

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """How to sample one request's completions.

    Field names and defaults follow vLLM's ``SamplingParams``. Invalid values raise ``ValueError``
    at construction, naming the field and its allowed range, so nothing downstream re-validates.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # A JSON schema / regex / choice / grammar the output must follow (a dict is converted).
    structured_outputs: StructuredOutputsParams | dict | None = None
    # Added to the token's logit before penalties and sampling (greedy rows too), as vLLM and
    # OpenAI's logit_bias; -inf bans it. Keys are token ids.
    logit_bias: dict[int, float] | None = None
    # Only these token ids may be sampled (vLLM's allowed_token_ids).
    allowed_token_ids: list[int] | None = None
    # Keep only the prompt's last k tokens (left truncation, vLLM's); -1: as many as max_model_len
    # leaves room for (max_model_len - 1).
    truncate_prompt_tokens: int | None = None
    # Words the output may not contain (vLLM's bad_words): each word's tokens, as it stands and after
    # a space, may not be generated in a row; a one-token word is never sampled.
    bad_words: str | list[str] | None = None
    # Filled in by the engine from the model's generation config (EOS ids beyond the tokenizer's).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    # Filled in by the engine: bad_words' token sequences (LLMEngine.bad_words_token_ids).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if isinstance(self.structured_outputs, dict):
            unknown = set(self.structured_outputs) - {f.name for f in fields(StructuredOutputsParams)}
            if unknown:
                raise ValueError(f"SamplingParams.structured_outputs has unknown keys {sorted(unknown)}; "
                                 "use json, regex, choice, grammar or json_object")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("SamplingParams.structured_outputs must be a StructuredOutputsParams or a dict, "
                             f"got {type(self.structured_outputs).__name__}")
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                pass  # _verify names the field
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def fail(name: str, rule: str) -> None:
            raise ValueError(f"SamplingParams.{name} must be {rule}, got {getattr(self, name)!r}")

        if not isinstance(self.n, int) or self.n < 1:
            fail("n", "an integer >= 1")
        if self.temperature < 0.0:
            fail("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            fail("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            fail("top_k", "an integer >= 1, or 0 / -1 for all tokens")
        if not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            fail("repetition_penalty", "> 0")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            fail("max_tokens", "an integer >= 1 (or None for up to max_model_len)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            fail("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail("min_tokens", f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            fail("logprobs", "None or an integer >= 0")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0
        ):
            fail("prompt_logprobs", "None or an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            fail("seed", "None or an integer")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop", "a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids", "a list of non-negative integers")
        if self.logit_bias is not None and (not isinstance(self.logit_bias, dict) or any(
                not isinstance(t, int) or isinstance(t, bool) or t < 0 or isinstance(b, bool)
                or not isinstance(b, (int, float)) or math.isnan(b) or b == math.inf
                for t, b in self.logit_bias.items())):
            fail("logit_bias", "a dict of token id (an integer >= 0) to a bias (a number, < +inf)")
        if self.allowed_token_ids is not None and (
                not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids
                or any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids)):
            fail("allowed_token_ids", "a non-empty list of token ids (integers >= 0)")
        if self.truncate_prompt_tokens is not None and (
                not isinstance(self.truncate_prompt_tokens, int) or isinstance(self.truncate_prompt_tokens, bool)
                or not (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)):
            fail("truncate_prompt_tokens", "None, an integer >= 1, or -1 for up to max_model_len - 1")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple)) or any(
                not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            fail("bad_words", "a list of strings that are not empty or all whitespace")
        if not isinstance(self.output_kind, RequestOutputKind):
            fail("output_kind", "a RequestOutputKind (CUMULATIVE 0, DELTA 1 or FINAL_ONLY 2)")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
