"""Per-request sampling parameters, with vLLM's field names and meanings."""
from __future__ import annotations

from dataclasses import dataclass, field

# Temperatures below this are greedy (argmax), as in vLLM.
SAMPLING_EPS = 1e-5


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
    # Filled in by the engine from the model's generation config (EOS ids beyond the tokenizer's).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
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

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def clone(self) -> "SamplingParams":
        import copy

        return copy.deepcopy(self)
