"""Speculative decoding by prompt lookup (vLLM's "ngram" method, the draft-model-free kind).

For a greedy sequence the proposer looks for the sequence's last ``n`` tokens (``n`` from
``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in its own prompt + output, and
proposes the tokens that followed their most recent earlier occurrence. The scheduler gives the
sequence ``1 + len(draft)`` query tokens; the forward pass yields logits at each of them, and the
engine keeps the model's token at every position up to and including the first one where the
draft disagrees with it (``accept``). The kept tokens are exactly those plain greedy decoding
would have produced, one step at a time.

Each sequence carries an index of its n-grams (a dict per ``n`` from n-gram to the position it
ends at), extended by the tokens appended since the last lookup, so a proposal costs a few dict
operations per new token rather than a scan of the history.
"""
from __future__ import annotations

from engine_service.sequence import Sequence


class NgramIndex:
    """The n-grams of one token list, ``n`` in [nmin, nmax], each mapped to where its most recent
    occurrence ends; covers the n-grams ending before the list's last token."""

    __slots__ = ("nmin", "nmax", "maps", "upto")

    def __init__(self, nmin: int, nmax: int):
        self.nmin, self.nmax = nmin, nmax
        self.maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(nmax + 1)]
        self.upto = 0  # n-grams ending at positions < upto are indexed

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest
        matching suffix of ``tokens``; [] when none of its last nmin..nmax tokens occurred before."""
        last = len(tokens) - 1
        for end in range(self.upto, last):  # index what was appended since the last call
            for n in range(self.nmin, min(self.nmax, end + 1) + 1):
                self.maps[n][tuple(tokens[end - n + 1:end + 1])] = end
        self.upto = max(self.upto, last)
        for n in range(min(self.nmax, last + 1), self.nmin - 1, -1):
            end = self.maps[n].get(tuple(tokens[last - n + 1:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.nmin, self.nmax = prompt_lookup_min, prompt_lookup_max

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        """Sequences whose next token is a plain argmax of the logits: greedy, one completion, no
        logprobs, penalties, logit bias, bad words or grammar, and past min_tokens (whose masking depends on
        the position)."""
        p = seq.params
        return (p.greedy and p.n == 1 and p.logprobs is None and seq.grammar is None
                and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and p.repetition_penalty == 1.0
                and not p.logit_bias and p.allowed_token_ids is None and not p.bad_words
                and seq.num_output_tokens >= p.min_tokens)

    def propose(self, seq: Sequence, max_len: int) -> list[int]:
        """At most ``min(k, max_len)`` draft tokens for ``seq`` (which has one token to compute)."""
        k = min(self.k, max_len)
        if k <= 0 or not self.eligible(seq):
            return []
        if seq.ngram_index is None:
            seq.ngram_index = NgramIndex(self.nmin, self.nmax)
        return seq.ngram_index.lookup(seq.token_ids, k)


def accept(draft: list[int], targets: list[int]) -> list[int]:
    """The tokens kept from one verified draft: ``targets[i]`` is the model's token after the
    sequence plus ``draft[:i]``; keep targets up to and including the first disagreement."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return targets[:n + 1]
