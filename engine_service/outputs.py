"""What the engine hands back: vLLM's ``RequestOutput`` / ``CompletionOutput`` shapes."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine_service.sequence import RequestMetrics


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank among the vocabulary
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One completion. ``text``/``token_ids`` are cumulative; the ``delta_*`` fields hold only
    what this step added (what a stream sends)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[dict[int, Logprob]] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the request was refused (LLM.generate keeps the others)
