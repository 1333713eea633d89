"""Incremental detokenization of one output sequence, with stop-string matching.

The engine feeds each step's new token ids to ``update`` and streams ``get_delta``. Decoding uses
vLLM's prefix/read-offset scheme: each step decodes only a small window (the tokens since the last
character boundary plus the few before it, for context), so its cost does not grow with the
sequence length. Text is confirmed only up to a character boundary: a character whose UTF-8 bytes
are split across tokens (byte-level BPE, byte fallback) is never emitted half.

``tokenizers.decoders.DecodeStream`` implements the same window in Rust, but it exposes neither its
pending tokens (so text still pending when the sequence finishes could not be flushed, and the final
text would differ from ``tokenizer.decode``) nor the complete text ahead of a pending partial
character (which stop strings must see); each step here is two ~µs decodes of a few tokens.
"""
from __future__ import annotations

from engine_service.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for incomplete or invalid UTF-8
# Prompt tokens decoded as left context of the first output token, as vLLM does: decoders that
# strip a leading space from the first token of a decode call (SentencePiece's Metaspace) would
# otherwise drop the space the first generated word starts with. Byte-level BPE needs none, and
# there the output equals ``tokenizer.decode(output_ids)`` exactly.
NUM_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, incrementally.

    Invariants: the concatenation of all ``get_delta`` results equals ``output_text``; once the
    sequence has finished that equals ``tokenizer.decode(output_ids, skip_special_tokens=...)``,
    cut at the matched stop string if one matched. The prompt's text is never part of it.

    Text is kept as a list of handed-out pieces plus a short unsent remainder, so ``update`` and
    ``get_delta`` cost O(new text + longest stop string) whatever the sequence length.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._detokenize = params.detokenize
        # Clean-up of tokenization spaces rewrites text across token boundaries (" ." -> "."), so
        # it cannot be done incrementally; vLLM does not apply it either. Without it, a fast
        # tokenizer's decode is its Rust backend's (called directly: ~1 µs instead of ~2.5 µs).
        skip = params.skip_special_tokens
        backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is not None:
            self._decode_fn = lambda ids: backend.decode(ids, skip_special_tokens=skip)
        else:
            spaces = params.spaces_between_special_tokens
            self._decode_fn = lambda ids: tokenizer.decode(
                ids, skip_special_tokens=skip, spaces_between_special_tokens=spaces,
                clean_up_tokenization_spaces=False)
        self._stops = list(params.stop) if params.detokenize else []
        self._include_stop = params.include_stop_str_in_output
        self._min_tokens = params.min_tokens
        # Chars of text before new text that a stop string completed by the new text can start in.
        self._stop_lookback = max(map(len, self._stops), default=1) - 1
        self._stop_prefixes = {s[:k] for s in self._stops for k in range(1, len(s))}

        # Decode window: tokens from the prefix offset on; those before ``_read`` are context whose
        # text (``_prefix_text``) was already confirmed (or is the prompt's).
        context = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:]) if params.detokenize else []
        prefix_text = self._decode(context)
        if prefix_text.endswith(REPLACEMENT_CHAR):  # prompt ends inside a character: no context
            context, prefix_text = [], ""
        self._window: list[int] = context
        self._read = len(context)
        self._prefix_text = prefix_text
        # Complete text decoded from the window's pending tokens, ahead of a partial character;
        # not streamed yet, but visible to stop strings.
        self._tail = ""

        self._num_output_tokens = 0
        self._closed = False  # a stop string matched, or the final flush happened
        self._sent: list[str] = []  # deltas handed out
        self._unsent: list[str] = []  # confirmed text not handed out yet
        self._unsent_len = 0
        self._recent = ""  # the last ``_stop_lookback`` chars of the unsent text (or all of it)

    def _decode(self, token_ids: list[int]) -> str:
        return self._decode_fn(token_ids) if token_ids else ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append newly generated tokens.

        Returns the stop string that now appears in the text (earliest match wins), or None. On a
        match the text is cut before the stop string (after it with ``include_stop_str_in_output``)
        and later tokens are ignored: the caller finishes the sequence. Stop strings are looked for
        once at least ``min_tokens`` tokens were generated, and never with ``detokenize=False``.
        """
        self._num_output_tokens += len(new_token_ids)
        if self._closed or not self._detokenize or not new_token_ids:
            return None
        window = self._window
        window.extend(new_token_ids)
        text = self._decode(window)[len(self._prefix_text):]
        stops = self._stops
        old_end = len(self._recent) + len(self._tail) if stops else 0  # stop region already searched
        if text and not text.endswith(REPLACEMENT_CHAR):
            # The window ends on a character boundary: confirm its text and slide the window.
            new, self._tail = text, ""
            self._window = window[self._read:]
            self._read = len(self._window)
            self._prefix_text = self._decode(self._window)
        else:
            # Stripping a legitimate U+FFFD only delays that char to the next boundary or flush.
            new, self._tail = "", text.rstrip(REPLACEMENT_CHAR)
        if not stops:  # nothing to look for (``_recent`` stays empty)
            if new:
                self._unsent.append(new)
                self._unsent_len += len(new)
            return None
        region = self._recent + new + self._tail
        region_start = self._unsent_len - len(self._recent)  # index of region[0] in the unsent text
        self._unsent_len += len(new)
        if new:
            self._unsent.append(new)
            recent = self._recent + new
            self._recent = recent[max(0, len(recent) - self._stop_lookback):]
        if self._num_output_tokens < self._min_tokens:
            return None
        return self._match_stop(region, old_end, region_start)

    def _match_stop(self, region: str, old_end: int, region_start: int) -> str | None:
        """Cut the text at the earliest stop string in ``region`` ending after ``old_end``."""
        matches = [(i, i + len(stop), stop) for stop in self._stops
                   if (i := region.find(stop, max(0, old_end - len(stop) + 1))) >= 0]
        if not matches:
            return None
        start, end, stop = min(matches)  # earliest start; on a tie, the one completed first
        cut = region_start + (end if self._include_stop else start)
        # The cut never reaches into handed-out text: get_delta holds back every stop prefix.
        text = ("".join(self._unsent) + self._tail)[:cut]
        self._unsent, self._unsent_len, self._recent = ([text] if text else []), len(text), ""
        self._closed, self._window, self._tail = True, [], ""
        return stop

    def get_delta(self, finished: bool) -> str:
        """The text not handed out yet, and mark it handed out.

        While not ``finished``, holds back a partial character and the longest suffix of the text
        that could still grow into a stop string. When ``finished``, also decodes tokens still
        pending (so invalid bytes come out as U+FFFD, exactly as ``tokenizer.decode`` has them)
        and hands out everything.
        """
        if finished:
            self._flush()
        held = 0 if finished or not self._stops else max(
            0, self._held_stop_prefix_len(self._recent + self._tail) - len(self._tail))
        if self._unsent_len <= held:
            return ""
        text = "".join(self._unsent)
        delta, rest = text[:len(text) - held], text[len(text) - held:]
        self._unsent, self._unsent_len = ([rest] if rest else []), held
        self._recent = self._recent[len(self._recent) - held:]
        self._sent.append(delta)
        return delta

    def _held_stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._stop_lookback), 0, -1):
            if text[-k:] in self._stop_prefixes:
                return k
        return 0

    def _flush(self) -> None:
        """Decode the pending tokens as they are (partial characters become U+FFFD)."""
        if self._closed or not self._detokenize:
            return
        text = self._decode(self._window)[len(self._prefix_text):]
        if text:
            self._unsent.append(text)
            self._unsent_len += len(text)
        self._closed, self._window, self._tail = True, [], ""

    @property
    def output_text(self) -> str:
        """All text so far (cut at a matched stop string); excludes a pending partial character.

        O(length of the text): read it when needed rather than every step.
        """
        text = "".join(self._sent)
        self._sent = [text] if text else []
        return text + "".join(self._unsent)


def texts_of_tokens(tokenizer, token_ids) -> list[str]:
    """Each token's text on its own, as ``Logprob.decoded_token`` gives it (vLLM's): the token
    converted to a string by itself, so a token holding part of a multi-byte character reads as
    U+FFFD. Ids the tokenizer does not know (a model vocabulary padded past it) read as ""."""
    tokens = tokenizer.convert_ids_to_tokens(list(token_ids))
    return [tokenizer.convert_tokens_to_string([t]) if t is not None else "" for t in tokens]


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """``texts_of_tokens`` of the whole vocabulary, made once per engine (~0.1 s for 49k tokens) so
    that logprobs never decode in a step."""
    return texts_of_tokens(tokenizer, range(max(vocab_size, len(tokenizer))))
