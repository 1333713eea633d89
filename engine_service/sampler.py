"""Batched token sampler: structured-output masks, penalties, min_tokens, temperature, min_p /
top_k / top_p, logprobs.

Semantics follow vLLM V1's sampler. On CPU everything after the grammar's mask (penalties,
min_tokens, temperature, the filters, the draw) is one C++ pass a row (``CpuLayerOps.sample``: the
filters' thresholds by selection, no sort; one uniform a row, no noise per token). The torch path
here is the reference it is tested against, and the path elsewhere: every stage works on whole
[rows, vocab] tensors and is skipped when no row needs it. Either way the only per-row Python work
is building small parameter tensors and drawing the random numbers of seeded rows from their own
generators.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from typing import TYPE_CHECKING

import torch

from engine_service.sampling_params import SamplingParams
from pagoda_kernels.layer_ops import TorchLayerOps

if TYPE_CHECKING:
    from engine_service.structured_output import StructuredBatch

_NEG_INF = float("-inf")


@dataclass
class SamplingBatch:
    """One row per sequence that samples a token this step."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]  # per row: the prompt (for repetition_penalty)
    output_token_ids: list[list[int]]  # per row: tokens generated so far (penalties, min_tokens)
    generators: list[torch.Generator | None]  # per row: a generator for seeded rows, None otherwise
    structured: "StructuredBatch | None" = None  # the rows under a grammar; None when there are none

    @cached_property
    def argmax_only(self) -> bool:
        """Whether every row just takes the argmax of its logits as they are: greedy, no
        penalties or logit bias, no min_tokens still to reach, no logprobs, no grammar (worked out once a step:
        the runner and the sampler both ask)."""
        return self.structured is None and all(
            p.greedy and p.logprobs is None and not _has_penalties(p) and not _has_bias(p)
            and len(out) >= p.min_tokens for p, out in zip(self.params, self.output_token_ids))


@dataclass
class SamplerOutput:
    """The sampled token of each row and, when any row asked for them, its logprobs.

    Logprobs are of the raw model logits (before penalties and temperature), as vLLM V1 returns
    by default. They are computed for every row once any row asks; rows that asked for fewer
    than K top logprobs use a prefix of ``topk_*`` (K may be 0: then ``topk_*`` are [B, 0]).
    """

    sampled_token_ids: torch.Tensor  # [B] int64
    sampled_logprobs: torch.Tensor | None  # [B] float32 (None when no row asked for logprobs)
    topk_token_ids: torch.Tensor | None  # [B, K] int64, K = max logprobs asked in the batch
    topk_logprobs: torch.Tensor | None  # [B, K] float32
    sampled_ranks: torch.Tensor | None = None  # [B] int64: 1 + the raw logits above the sampled token's


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``; keep one per sequence across steps."""
    return torch.Generator(device="cpu").manual_seed(seed)


class Sampler:
    """Samples one token per row from ``logits`` [B, >= vocab_size] for a ``SamplingBatch``.

    Columns beyond ``vocab_size`` (padding) are ignored. The input logits are never modified.
    ``eos_token_ids`` are masked, together with each row's stop token ids, while a row has fewer
    than ``min_tokens`` output tokens.
    """

    def __init__(self, vocab_size: int, eos_token_ids: set[int], argmax=None, sample=None, logprobs=None):
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)
        # The all-greedy batch's argmax (first maximum per row): a layer-ops kernel where there is one.
        self.argmax = argmax or TorchLayerOps().argmax
        # Every row's token in one pass a row (``CpuLayerOps.sample``: the filters by selection, one
        # uniform a row), where there is such a kernel; None: the torch path below, which sorts the
        # vocabulary for top_p and draws an exponential per token (256 rows of 49152: 0.22 s at a
        # temperature, 0.61 s with top_p, against a few ms; bench/RESULTS.md).
        self.sample = sample
        # Raw logprobs: the sampled token's and the top K of each row (a layer-ops kernel where there
        # is one: two passes a row instead of a [B, V] log_softmax and topk).
        self.logprobs = logprobs or TorchLayerOps().logprobs

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        logits = logits[:, : self.vocab_size]
        if batch.argmax_only:
            # The first-maximum index, on the logits as they are (no widening to float32 first).
            return SamplerOutput(self.argmax(logits), None, None, None)
        params = batch.params
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        penalized = [i for i, p in enumerate(params) if _has_penalties(p)]
        min_tokens_rows = [
            i for i, p in enumerate(params) if len(batch.output_token_ids[i]) < p.min_tokens
        ]
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        structured = batch.structured

        raw = logits
        biased = [i for i, p in enumerate(params) if _has_bias(p)]
        if self.sample is None or structured is not None:
            logits = logits.float()  # (the kernel reads bf16 logits as they are)
        if structured is not None:
            # First, as in vLLM: the grammar decides which tokens exist, the rest samples among them.
            logits = structured.masker.apply(logits, structured)
        if biased:  # then allowed_token_ids, bad_words and logit_bias, before penalties (vLLM's order)
            # In place on a float32 tensor of the sampler's own: copied here only if it is still the input.
            own = logits.to(torch.float32, copy=True) if logits is raw else logits
            logits = self._apply_bias(own, batch, biased)
        if self.sample is not None:  # the penalties and min_tokens' ban too, row by row
            sampled = self._sample_rows(logits, batch, penalized, min_tokens_rows)
        else:
            sampled = self._sample_torch(logits, batch, penalized, min_tokens_rows, random_rows)

        if not num_logprobs:
            return SamplerOutput(sampled, None, None, None)
        token_lp, rank, top_ids, top_lp = self.logprobs(raw, sampled, min(max(num_logprobs), self.vocab_size))
        return SamplerOutput(sampled, token_lp, top_ids, top_lp, rank)

    def _apply_bias(self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        """``logits`` (float32, the sampler's own copy) with each of ``rows``' tokens outside its
        allowed_token_ids or ending one of its bad words at -inf and its logit_bias added, in place
        (one scatter for the batch each)."""
        params = batch.params
        allowed = [i for i in rows if params[i].allowed_token_ids]
        if allowed:
            idx = torch.tensor(allowed)
            lists = [params[i].allowed_token_ids for i in allowed]
            col = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
            row = torch.repeat_interleave(torch.arange(len(lists)), torch.tensor([len(x) for x in lists]))
            keep = torch.zeros(len(allowed), logits.shape[1], dtype=torch.bool)
            keep[row, col] = True
            logits[idx] = logits[idx].masked_fill_(~keep, _NEG_INF)
        banned = [(i, t) for i in rows if params[i].bad_words_token_ids
                  for t in _bad_word_ends(params[i].bad_words_token_ids, batch.output_token_ids[i])]
        if banned:
            logits[tuple(torch.tensor(banned).T)] = _NEG_INF
        biased = [i for i in rows if params[i].logit_bias]
        if biased:
            row = torch.tensor([i for i in biased for _ in params[i].logit_bias])
            col = torch.tensor([t for i in biased for t in params[i].logit_bias])
            bias = torch.tensor([b for i in biased for b in params[i].logit_bias.values()], dtype=torch.float32)
            logits.index_put_((row, col), bias, accumulate=True)
        return logits

    def _apply_penalties(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]
    ) -> torch.Tensor:
        """Repetition penalty over prompt + output tokens, presence/frequency over output only."""
        device = logits.device
        idx = torch.tensor(rows, device=device)
        params = [batch.params[i] for i in rows]
        sub = logits[idx]
        output_counts = self._token_counts([batch.output_token_ids[i] for i in rows], device)
        repetition = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in repetition):
            prompt_counts = self._token_counts([batch.prompt_token_ids[i] for i in rows], device)
            seen = (prompt_counts + output_counts) > 0
            rep = torch.tensor(repetition, device=device).unsqueeze(1)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
        presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
        sub = sub - frequency * output_counts - presence * (output_counts > 0)
        return logits.index_copy(0, idx, sub)

    def _token_counts(self, token_ids: list[list[int]], device: torch.device) -> torch.Tensor:
        """[rows, vocab_size] float32 count of each token id in each row's list."""
        vocab_size = self.vocab_size
        lengths = torch.tensor([len(t) for t in token_ids], device=device)
        # clamp: an out-of-range id lands in a spare column that is dropped (no sync, no overflow
        # into the next row).
        flat = torch.tensor(list(chain.from_iterable(token_ids)), dtype=torch.long, device=device)
        flat = flat.clamp(0, vocab_size)
        row = torch.repeat_interleave(torch.arange(len(token_ids), device=device), lengths)
        width = vocab_size + 1
        counts = torch.bincount(row * width + flat, minlength=len(token_ids) * width)
        return counts.view(len(token_ids), width)[:, :vocab_size].float()

    def _stop_ids(self, p: SamplingParams) -> list[int]:
        """The ids a row short of its min_tokens may not sample: EOS and its stop token ids."""
        return [t for t in self.eos_token_ids | set(p.stop_token_ids) | p.all_stop_token_ids if t < self.vocab_size]

    def _mask_stop_tokens(
        self, logits: torch.Tensor, batch: SamplingBatch, rows: list[int]
    ) -> torch.Tensor:
        """Forbid EOS and stop token ids in rows that have not yet reached min_tokens."""
        row_ids: list[int] = []
        col_ids: list[int] = []
        for i in rows:
            stop_ids = self._stop_ids(batch.params[i])
            row_ids += [i] * len(stop_ids)
            col_ids += stop_ids
        if not col_ids:
            return logits
        device = logits.device
        index = (torch.tensor(row_ids, device=device), torch.tensor(col_ids, device=device))
        return logits.index_put(index, torch.tensor(_NEG_INF, device=device))

    def _sample_torch(self, logits: torch.Tensor, batch: SamplingBatch, penalized: list[int],
                      min_tokens_rows: list[int], random_rows: list[int]) -> torch.Tensor:
        """Every row's token with torch ops on whole [rows, vocab] tensors (the reference; the
        kernel's rules are these)."""
        params = batch.params
        if penalized:
            logits = self._apply_penalties(logits, batch, penalized)
        if min_tokens_rows:
            logits = self._mask_stop_tokens(logits, batch, min_tokens_rows)
        if len(random_rows) == len(params):
            return self._sample_random(logits, params, batch.generators)
        # Greedy rows take the argmax after penalties but before temperature etc., as in vLLM.
        sampled = logits.argmax(-1)
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            random_sampled = self._sample_random(
                logits[idx],
                [params[i] for i in random_rows],
                [batch.generators[i] for i in random_rows],
            )
            sampled = sampled.index_copy(0, idx, random_sampled)
        return sampled

    def _sample_rows(self, logits: torch.Tensor, batch: SamplingBatch, penalized: list[int],
                     min_tokens_rows: list[int]) -> torch.Tensor:
        """Every row's token with the ``sample`` kernel, penalties and min_tokens' ban included:
        greedy rows take the argmax, the others one draw at a uniform of their own generator
        (seeded rows: their tokens depend on the seed alone, not on the batch) or of the global
        one."""
        params, generators = batch.params, batch.generators
        vocab_size = logits.shape[1]
        temperature = torch.tensor([0.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab_size else 0 for p in params], dtype=torch.long)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
        uniform = torch.rand(len(params), dtype=torch.float64)
        for i, g in enumerate(generators):
            if g is not None:
                uniform[i] = torch.rand(1, dtype=torch.float64, generator=g)[0]
        penalties = prompt = output = banned = None
        if penalized:
            rows = set(penalized)
            penalties = torch.tensor([(p.repetition_penalty, p.frequency_penalty, p.presence_penalty)
                                      for p in params], dtype=torch.float32)
            prompt = _flat([batch.prompt_token_ids[i] if i in rows and params[i].repetition_penalty != 1.0 else ()
                            for i in range(len(params))])
            output = _flat([batch.output_token_ids[i] if i in rows else () for i in range(len(params))])
        if min_tokens_rows:
            rows = set(min_tokens_rows)
            banned = _flat([sorted(self._stop_ids(params[i])) if i in rows else () for i in range(len(params))])
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        return self.sample(logits, temperature, top_k, top_p, min_p, uniform, penalties, prompt, output, banned)

    def _sample_random(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:
        """Temperature, min_p, top_k, top_p, then one draw per row by the exponential race."""
        device = logits.device
        vocab_size = logits.shape[1]
        temperature = [p.temperature for p in params]
        if any(t != 1.0 for t in temperature):
            logits = logits / torch.tensor(temperature, device=device).unsqueeze(1)
        min_p = [p.min_p for p in params]
        if any(m > 0.0 for m in min_p):
            probs = logits.softmax(-1)
            threshold = torch.tensor(min_p, device=device).unsqueeze(1) * probs.amax(-1, keepdim=True)
            logits = logits.masked_fill(probs < threshold, _NEG_INF)
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [p.top_p for p in params]
        if any(p < 1.0 for p in top_p):
            logits = _apply_top_k_top_p(logits, top_k, top_p)
        elif any(k < vocab_size for k in top_k):
            logits = _apply_top_k(logits, top_k)

        probs = logits.softmax(-1)
        # argmax(probs / q) with q ~ Exp(1) samples from probs (the exponential race) without a
        # cumsum/searchsorted and with no device sync.
        seeded = [i for i, g in enumerate(generators) if g is not None]
        if len(seeded) == len(params):
            q = self._seeded_exponentials(generators, seeded, vocab_size).to(device)
        else:
            q = torch.empty_like(probs).exponential_()
            if seeded:
                q[torch.tensor(seeded, device=device)] = self._seeded_exponentials(
                    generators, seeded, vocab_size
                ).to(device)
        # exponential_ can return 0; 0/0 would be NaN, which argmax would pick.
        q.clamp_min_(torch.finfo(torch.float32).tiny)
        return probs.div_(q).argmax(-1)

    @staticmethod
    def _seeded_exponentials(
        generators: list[torch.Generator | None], rows: list[int], vocab_size: int
    ) -> torch.Tensor:
        # Each seeded row draws its own [V] from its own generator, so its tokens depend only on
        # its seed, not on the batch it shares or its row index.
        return torch.stack(
            [torch.empty(vocab_size, device="cpu").exponential_(generator=generators[i]) for i in rows]
        )


def _flat(lists) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of token ids as one int64 tensor and each list's start ([len(lists) + 1])."""
    lengths = [len(x) for x in lists]
    starts = torch.zeros(len(lists) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0, out=starts[1:])
    return torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long), starts


def _has_bias(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.allowed_token_ids is not None or bool(p.bad_words)


def _bad_word_ends(sequences: list[list[int]], output: list[int]) -> list[int]:
    """The tokens that would complete one of ``sequences`` after ``output`` (vLLM's bad_words: a
    sequence's last token is banned where the output ends with the rest of it; the prompt does not count)."""
    n = len(output)
    return [s[-1] for s in sequences if len(s) == 1 or (len(s) <= n + 1 and output[n - len(s) + 1:] == s[:-1])]


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's tokens >= its k-th largest logit (ties kept, as in vLLM); k = V: all."""
    vocab_size = logits.shape[1]
    device = logits.device
    limited = [k < vocab_size for k in top_k]
    # topk only up to the largest *limited* k, so one unlimited row does not force a full sort.
    max_k = max(k for k, lim in zip(top_k, limited) if lim)
    k = torch.tensor([k if lim else 1 for k, lim in zip(top_k, limited)], device=device)
    kth = logits.topk(max_k, dim=-1).values.gather(1, (k - 1).unsqueeze(1))
    kth = kth.masked_fill(~torch.tensor(limited, device=device).unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """top_k then top_p on one ascending sort; top_p keeps the smallest set with mass >= p."""
    vocab_size = logits.shape[1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1)
    if any(k < vocab_size for k in top_k):
        k = torch.tensor(top_k, device=device)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop = cumulative <= 1.0 - torch.tensor(top_p, device=device).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
