"""Iteration-level scheduler: decides, every step, which sequences advance by how many tokens.

Every step is one batch under one token budget (``max_num_batched_tokens``) and one sequence
budget (``max_num_seqs``): running decodes first, then running prefills that are mid-chunk, then
waiting sequences FCFS, chunked to fit. When blocks run out the most recently admitted sequence
is preempted (recompute, or swap to host memory) and put back at the front of the queue. With
speculative decoding on, a decode also carries the draft tokens the proposer guessed for it
(``seq.spec_token_ids``: more query tokens, the same one sequence) as far as the token budget
allows, in new KV blocks only while one free block per running sequence remains, so that no
draft costs another sequence a preemption. The scheduler never touches tensors: it returns a
plain ``SchedulerOutput``.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

from engine_service.block_manager import BlockManager
from engine_service.config import EngineConfig
from engine_service.sequence import Sequence, SequenceStatus
from engine_service.spec_decode import NgramProposer


@dataclass
class SchedulerOutput:
    """What one step computes: ``num_new_tokens`` more tokens for each scheduled sequence."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.blocks_to_swap_out


class Scheduler:
    """Owns the waiting, running and swapped queues and the block manager."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, config.num_swap_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self.swapped: deque[Sequence] = deque()
        self._admissions = itertools.count()
        self.num_preemptions = 0
        # Speculative draft tokens verified and accepted (the engine, which verifies them, counts).
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.proposer = (NgramProposer(config.num_speculative_tokens, config.prompt_lookup_min,
                                       config.prompt_lookup_max) if config.num_speculative_tokens else None)
        # Tokens the waiting queue still has to compute (waiting sequences hold no KV), kept as
        # the queue changes so a load report never walks the queue.
        self._num_waiting_tokens = 0

    # ---- queue management ---------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._num_waiting_tokens += seq.num_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def num_waiting_tokens(self) -> int:
        return self._num_waiting_tokens

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retire a sequence and free its blocks at once (finished, stopped or aborted)."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self._num_waiting_tokens -= seq.num_tokens
            self.block_manager.free(seq)
        elif seq.status == SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq)
        seq.status = status

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` sharing all of ``parent``'s KV blocks (``n > 1`` sampling)."""
        self.block_manager.fork(parent, child)
        child.status = SequenceStatus.RUNNING
        child.admitted_order = next(self._admissions)
        self.running.append(child)

    # ---- the step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        planned: dict[int, tuple[Sequence, int, list[tuple[int, int]]]] = {}
        bm = self.block_manager

        # Running sequences: decodes first, then prefills that are mid-chunk, in admission order.
        queue = sorted(self.running, key=lambda s: (s.num_tokens - s.num_computed_tokens > 1, s.admitted_order))
        for seq in queue:
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            seq.spec_token_ids = []
            copies = None
            if self.proposer is not None and seq.num_tokens - seq.num_computed_tokens == 1:
                draft = self.proposer.propose(seq, self._max_draft_len(seq, budget))
                if draft and (copies := bm.allocate_slots(seq, 1 + len(draft))) is not None:
                    seq.spec_token_ids = draft
                    num_new += len(draft)
            while copies is None and (copies := bm.allocate_slots(seq, num_new)) is None:
                victim = self.running[-1]
                if victim.seq_id in planned:
                    _, n, _ = planned.pop(victim.seq_id)
                    budget += n
                self._preempt(victim, out)
                if victim is seq:
                    break
            if copies is None:
                continue
            planned[seq.seq_id] = (seq, num_new, copies)
            budget -= num_new

        # Swapped-out sequences come back before anything new is admitted.
        while self.swapped and not out.preempted and budget > 0:
            seq = self.swapped[0]
            if len(self.running) >= self.config.max_num_seqs or not bm.can_swap_in(seq):
                break
            self.swapped.popleft()
            out.blocks_to_swap_in += bm.swap_in(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            copies = bm.allocate_slots(seq, num_new)
            if copies is None:  # swapped in but no room to grow: wait for the next step
                copies, num_new = [], 0
            self._admit(seq)
            if num_new:
                planned[seq.seq_id] = (seq, num_new, copies)
                budget -= num_new

        # Waiting sequences, FCFS; nothing new while the step had to preempt or unswap.
        bs = self.config.block_size
        while self.waiting and not out.preempted and not self.swapped and budget > 0:
            seq = self.waiting[0]
            if len(self.running) + 1 + seq.num_pending_forks > self.config.max_num_seqs:
                break
            # (a prompt whose logprobs are asked for is computed whole: a cache hit would skip rows)
            computed = bm.get_computed_blocks(seq) if not seq.needs_prompt_logprobs else []
            num_new = seq.num_tokens - seq.num_computed_tokens - len(computed) * bs
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            copies = bm.allocate_slots(seq, num_new, computed)
            if copies is None:
                break
            self.waiting.popleft()
            self._num_waiting_tokens -= seq.num_tokens
            if seq.request.metrics.first_scheduled_time is None:
                seq.num_cached_tokens = len(computed) * bs
                bm.prefix_queries += seq.num_tokens
                bm.prefix_hits += seq.num_cached_tokens
            self._admit(seq)
            planned[seq.seq_id] = (seq, num_new, copies)
            budget -= num_new

        for seq, num_new, copies in planned.values():
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            out.blocks_to_copy += copies
        return out

    def _max_draft_len(self, seq: Sequence, budget: int) -> int:
        """Draft tokens ``seq`` may carry: within the step's token budget, never more than it could
        still emit (max_tokens, max_model_len) after the pending token, and in new blocks only while
        the pool keeps one free block per running sequence (a draft must not cost anyone a
        preemption or a waiting request its admission); else within the blocks it holds."""
        left = self.config.max_model_len - seq.num_tokens
        max_tokens = seq.params.max_tokens
        if max_tokens is not None:
            left = min(left, max_tokens - seq.num_output_tokens)
        n = min(budget, left) - 1
        bm = self.block_manager
        held = len(seq.block_table) * bm.block_size - seq.num_computed_tokens - 1  # slots after the pending token
        if n > held:
            extra = bm.blocks_for(seq.num_computed_tokens + 1 + n) - max(
                len(seq.block_table), bm.blocks_for(seq.num_computed_tokens + 1))
            if bm.num_free_blocks - extra < len(self.running):
                n = max(0, held)
        return n

    def _admit(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = next(self._admissions)
        self.running.append(seq)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt the newest running sequence: swap it out if configured and possible, else
        drop its KV and recompute later; either way it goes back to the FRONT of its queue."""
        self.running.remove(seq)
        seq.spec_token_ids = []
        self.num_preemptions += 1
        out.preempted.append(seq)
        bm = self.block_manager
        if self.config.preemption_mode == "swap" and bm.can_swap_out(seq):
            out.blocks_to_swap_out += bm.swap_out(seq)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            return
        bm.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self._num_waiting_tokens += seq.num_tokens
