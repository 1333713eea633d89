"""Structured outputs: JSON schema, regex, choice and grammar constraints, enforced by masking the
logits of constrained rows to the tokens their grammar allows next.

Backed by llguidance. It was measured against xgrammar on the bundled tokenizer
(``bench/structured_backends.py``, see bench/RESULTS.md): mask fills per step are of the same order,
but llguidance compiles a JSON schema in ~2 ms where xgrammar takes ~500 ms, and compiling happens at
submission, on the engine thread, for every new schema a batch job brings; it also imports in
milliseconds (xgrammar's runtime takes ~5 s) and reads GBNF and Lark grammars.

The engine owns one ``StructuredOutputManager``, created at the first constrained request, so an
engine that never sees one never imports the library. Each constrained sequence owns a matcher
(``seq.grammar``) that advances by the tokens it samples.
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch

from engine_service.sampling_params import StructuredOutputsParams

logger = logging.getLogger("pagoda.structured_output")

_GRAMMAR_CACHE_SIZE = 256
_FIELD = "SamplingParams.structured_outputs"


def _one_line(message: str) -> str:
    """The library's multi-line diagnostics (with caret drawings of its internal grammar) as one line."""
    lines = [line.strip() for line in message.strip().splitlines()]
    return "; ".join(line for line in lines if line and not re.fullmatch(r"\^+|\d+ \|.*", line))


def _import_llguidance():
    # Not llguidance.torch: it applies torch.compile at import, which imports torch._dynamo (seconds);
    # its fill helper is the one call GrammarMasker.fill makes directly.
    import llguidance
    import llguidance.hf

    return llguidance


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar definition; ValueError names the field on bad input."""
    llg = _import_llguidance()
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else params.json
            if params.disable_any_whitespace:
                schema = json.loads(schema) if isinstance(schema, str) else schema
                if isinstance(schema, dict):
                    schema = {**schema, "x-guidance": {"whitespace_flexible": False,
                                                       **schema.get("x-guidance", {})}}
            return llg.grammar_from("json_schema", schema if isinstance(schema, str) else json.dumps(schema))
        if kind == "regex":
            return llg.grammar_from("regex", params.regex)
        if kind == "choice":
            return llg.grammar_from("choice", json.dumps(params.choice))
        # GBNF / EBNF (``root ::= ...``) or Lark (``start: ...``): llguidance tells them apart.
        return llg.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise ValueError(f"{_FIELD}.{kind} is invalid: {_one_line(str(e))}") from None


class GrammarMatcher:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher):
        self._matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id``; False when the grammar does not allow it (the matcher is then dead)."""
        return self._matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and allows no further token (EOS aside)."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


@dataclass
class StructuredBatch:
    """The constrained rows of one sampling step and their matchers."""

    rows: list[int]
    matchers: list[GrammarMatcher]
    masker: "GrammarMasker"


class GrammarMasker:
    """Fills the allowed-token bitmask of the constrained rows and applies it to their logits.

    The library fills a packed [rows, ceil(V/32)] int32 bitmask (bit j of word i: token 32*i + j)
    from its own threads; unpacking is one table lookup per byte (a [256, 8] table of 0 / -inf),
    so no Python touches vocabulary entries and unconstrained rows are not read at all.
    """

    def __init__(self, vocab_size: int, num_threads: int | None = None):
        llg = _import_llguidance()
        self._llg = llg
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._executor = llg.LLExecutor(num_threads=num_threads or min(4, os.cpu_count() or 1))
        self._bitmask = torch.empty(0, self.num_words, dtype=torch.int32)
        bits = (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1
        self._tables = {torch.device("cpu"): torch.zeros(256, 8).masked_fill_(bits == 0, float("-inf"))}

    def fill(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), ceil(V/32)] int32 bitmask of the tokens each matcher allows next."""
        k = len(matchers)
        if self._bitmask.shape[0] < k:
            self._bitmask = torch.empty(max(k, 2 * self._bitmask.shape[0]), self.num_words, dtype=torch.int32)
        bitmask = self._bitmask[:k]  # contiguous CPU int32 rows, as the library writes them
        self._executor.unsafe_compute_mask_ptr([(m._matcher, i) for i, m in enumerate(matchers)],
                                               bitmask.data_ptr(), self.num_words * 4, k)
        return bitmask

    def additive_mask(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """[rows, V] float32: 0 where allowed, -inf where not."""
        table = self._tables.get(device)
        if table is None:
            table = self._tables[device] = self._tables[torch.device("cpu")].to(device)
        # Little-endian bytes of each int32 word: byte b of the flattened view covers tokens 8b .. 8b+7.
        codes = bitmask.to(device).view(torch.uint8).reshape(-1).int()
        return table.index_select(0, codes).view(bitmask.shape[0], -1)[:, : self.vocab_size]

    def apply(self, logits: torch.Tensor, batch: StructuredBatch) -> torch.Tensor:
        """``logits`` [B, V] float32 with the constrained rows masked (a new tensor; the input is kept)."""
        mask = self.additive_mask(self.fill(batch.matchers), logits.device)
        if len(batch.rows) == logits.shape[0]:
            return logits + mask
        return logits.index_add(0, torch.tensor(batch.rows, device=logits.device), mask)


class StructuredOutputManager:
    """Compiles constraints (cached by their text) and makes the per-sequence matchers."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int] | None = None):
        llg = _import_llguidance()
        self._llg = llg
        eos = sorted(eos_token_ids) if eos_token_ids else None
        # ~1 s once per engine: llguidance preprocesses the whole vocabulary.
        self.ll_tokenizer = llg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.masker = GrammarMasker(vocab_size)
        # grammar key -> a fresh matcher to copy (copying skips re-parsing the grammar).
        self._templates: OrderedDict[tuple[str, str], object] = OrderedDict()

    def compile(self, params: StructuredOutputsParams) -> tuple[str, str]:
        """Check the constraint and cache it; returns the key ``new_matcher`` takes. ValueError if invalid."""
        key = params.cache_key()
        if key in self._templates:
            self._templates.move_to_end(key)
            return key
        matcher = self._llg.LLMatcher(self.ll_tokenizer, grammar_text(params))
        if matcher.is_error():
            raise ValueError(f"{_FIELD}.{params.kind} is invalid: {_one_line(matcher.get_error())}")
        self._templates[key] = matcher
        if len(self._templates) > _GRAMMAR_CACHE_SIZE:
            self._templates.popitem(last=False)
        return key

    def new_matcher(self, key: tuple[str, str], params: StructuredOutputsParams) -> GrammarMatcher:
        template = self._templates.get(key)
        if template is None:  # evicted since it was compiled
            self.compile(params)
            template = self._templates[key]
        return GrammarMatcher(template.deep_copy())

    def batch(self, seqs) -> StructuredBatch | None:
        """The constrained rows among ``seqs`` (the step's sampled sequences, in row order)."""
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not rows:
            return None
        return StructuredBatch(rows, [seqs[i].grammar for i in rows], self.masker)
