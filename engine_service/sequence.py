"""Requests and their sequences: the per-request state the scheduler and engine share.

A request owns ``n`` sequences (one per completion). Each sequence owns its counters: the
scheduler only ever brings ``num_computed_tokens`` up to ``num_tokens``, whether that is a
prefill, a chunk of one, a recompute after preemption or a decode.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from engine_service.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    # Set on each member below (plain attributes: the engine reads them for every sequence every
    # step, and a property with a set lookup cost ~0.2 s of a shared-workload run).
    is_finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished


for _status, _reason in ((SequenceStatus.WAITING, None), (SequenceStatus.RUNNING, None),
                         (SequenceStatus.SWAPPED, None), (SequenceStatus.FINISHED_STOPPED, "stop"),
                         (SequenceStatus.FINISHED_LENGTH, "length"), (SequenceStatus.FINISHED_ABORTED, "abort")):
    _status.is_finished = _reason is not None
    _status.finish_reason = _reason
del _status, _reason

_seq_ids = itertools.count()


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's milestones, as in vLLM."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


class Sequence:
    """One completion of a request: its tokens, KV blocks and progress counters."""

    def __init__(self, request: "Request", index: int, token_ids: list[int],
                 generator: torch.Generator | None):
        self.seq_id = next(_seq_ids)
        self.request = request
        self.index = index
        self.token_ids = token_ids
        self.num_prompt_tokens = request.num_prompt_tokens
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this sequence's full blocks
        self.num_registered_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.status = SequenceStatus.WAITING
        self.generator = generator
        self.num_pending_forks = 0  # n - 1 siblings forked from this one after its prefill
        self.stop_reason: str | int | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if request.params.logprobs is not None else None
        self.detokenizer = None  # set by the engine
        self.grammar = None  # a GrammarMatcher when the request has structured_outputs (set by the engine)
        self.admitted_order = -1  # scheduler's admission counter: preempt the newest first
        # Speculative decoding: the draft tokens this step verifies after the pending token (set by
        # the scheduler, consumed by the step), and the n-gram index they are looked up in.
        self.spec_token_ids: list[int] = []
        self.ngram_index = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether some of its prompt's logprobs are still to compute (its prefill may not skip
        prompt tokens through the prefix cache then)."""
        scored = self.request.prompt_logprobs
        return scored is not None and len(scored) < self.num_prompt_tokens

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request.request_id}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")


@dataclass
class Request:
    """A request as the engine tracks it: its prompt, parameters and sequences."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))
    priority: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    grammar_key: tuple[str, str] | None = None  # the compiled structured_outputs constraint, if any
    # With params.prompt_logprobs: entry j holds prompt token j's logprob and the top ones at its
    # position ({token id: Logprob}; entry 0 is None: nothing precedes the first token), filled as
    # the prefill chunks run.
    prompt_logprobs: list | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        seqs = self.seqs
        if len(seqs) == 1:  # n == 1: most requests
            return seqs[0].status.is_finished and not seqs[0].num_pending_forks
        return all(s.status.is_finished for s in seqs) and not any(s.num_pending_forks for s in seqs)
