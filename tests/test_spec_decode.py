"""Speculative decoding by prompt lookup: the proposer, the acceptance rule, how the scheduler and
block manager carry drafts, and (bundled model, float32 and bf16) that the engine's output with
drafts is the output without them, stops and streaming included."""
from __future__ import annotations

import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.config import EngineConfig
from engine_service.scheduler import Scheduler
from engine_service.sequence import Request, Sequence
from engine_service.spec_decode import NgramIndex, NgramProposer, accept
from tests.test_engine import _gemm_rows_depend_on_row_count, _multiply_in_fixed_row_slices
from tests.test_scheduler import make_config


def test_lookup_takes_the_longest_suffix_and_its_latest_occurrence():
    idx = NgramIndex(1, 3)
    tokens = [1, 2, 3, 9, 2, 3, 4, 5, 1, 2, 3]
    # [1, 2, 3] occurred at 0..2, followed by 9 2 3 4.
    assert idx.lookup(tokens, 4) == [9, 2, 3, 4]
    tokens += [7, 2, 3]
    # [7, 2, 3] never occurred before; the longest suffix that did is [2, 3], whose latest
    # earlier occurrence (ending at 10) is followed by 7, 2, 3.
    assert idx.lookup(tokens, 5) == [7, 2, 3]
    tokens.append(42)
    assert idx.lookup(tokens, 3) == []  # 42 never occurred before
    assert NgramIndex(2, 3).lookup([5, 6, 5], 2) == []  # a single-token match is below prompt_lookup_min


def test_lookup_index_grows_with_the_tokens():
    """Extending the list and looking up again gives what a fresh index over the whole list gives."""
    import random

    rng = random.Random(0)
    tokens, idx = [], NgramIndex(1, 3)
    for _ in range(300):
        tokens.append(rng.randrange(6))
        assert idx.lookup(tokens, 4) == NgramIndex(1, 3).lookup(list(tokens), 4)


def test_accept_keeps_the_models_tokens_up_to_the_first_disagreement():
    assert accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + the bonus token
    assert accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert accept([5, 6, 7], [4, 6, 7, 8]) == [4]
    assert accept([], [3]) == [3]


def _decoding_seqs(sched: Scheduler, *specs: tuple[list[int], int], **params) -> list[Sequence]:
    """Running sequences, one per (prompt, next token), prefilled together in one step and then
    given their next token, as after a decode step: every token but the last computed."""
    seqs = []
    for i, (tokens, _) in enumerate(specs):
        request = Request(f"r{i}", None, list(tokens), SamplingParams(temperature=0.0, **params))
        seq = Sequence(request, 0, list(tokens), None)
        request.seqs.append(seq)
        sched.add(seq)
        seqs.append(seq)
    out = sched.schedule()
    assert out.num_new_tokens == [len(t) for t, _ in specs]  # the prefills (no draft: tokens pending)
    for seq, (tokens, nxt) in zip(seqs, specs):
        assert seq.spec_token_ids == []
        seq.num_computed_tokens += len(tokens)
        seq.token_ids.append(nxt)
    return seqs


def _decoding_seq(sched: Scheduler, tokens: list[int], **params) -> Sequence:
    """One such sequence, its next token continuing the pattern of period 4."""
    return _decoding_seqs(sched, (tokens, tokens[len(tokens) % 4]), **params)[0]


def test_scheduler_gives_a_decode_its_draft_within_the_budget_and_blocks():
    sched = Scheduler(make_config(num_speculative_tokens=3))
    seq = _decoding_seq(sched, [5, 6, 7, 8, 5, 6, 7], max_tokens=20)
    out = sched.schedule()
    # The last three tokens [6, 7, 8] occurred at 1..3, followed by 5 6 7.
    assert seq.spec_token_ids == [5, 6, 7]
    assert out.num_new_tokens == [4]
    assert len(seq.block_table) * 4 >= seq.num_computed_tokens + 4
    sched.block_manager.check_invariants([seq])


@pytest.mark.parametrize("limits, expected", [
    (dict(max_num_batched_tokens=2), 1),   # budget: pending token + 1
    (dict(max_tokens=3), 1),               # 1 output so far, 3 allowed: pending + 1 draft
    (dict(max_tokens=2), 0),               # only the pending token's successor is left to emit
])
def test_draft_length_is_capped(limits, expected):
    budget = limits.get("max_num_batched_tokens", 32)
    sched = Scheduler(make_config(num_speculative_tokens=3, max_num_batched_tokens=max(budget, 7)))
    seq = _decoding_seq(sched, [5, 6, 7, 8, 5, 6, 7], max_tokens=limits.get("max_tokens", 20))
    sched.config.max_num_batched_tokens = budget
    out = sched.schedule()
    assert len(seq.spec_token_ids) == expected
    assert out.num_new_tokens == [1 + expected]


def test_drafts_take_no_block_another_sequence_needs():
    """Past the blocks a sequence holds, a draft takes new ones only while the pool keeps a free
    block per running sequence; else it is cut to the slots held, and nobody is preempted for it."""
    sched = Scheduler(make_config(num_speculative_tokens=3, num_blocks=4, max_num_batched_tokens=16))
    # a: 6 tokens in 2 blocks; b: 4 tokens in 1 block.
    a, b = _decoding_seqs(sched, ([5, 6, 7, 5, 6], 7), ([1, 2, 3], 1), max_tokens=20)
    assert sched.block_manager.num_free_blocks == 1
    out = sched.schedule()
    # a's lookup proposes 5 6 7; only positions 6 and 7 are in its blocks.
    assert a.spec_token_ids == [5, 6]
    assert b.spec_token_ids == []  # [1] occurred before, but its 4th slot ends b's only block
    assert out.num_new_tokens == [3, 1]
    assert sched.num_preemptions == 0 and sched.block_manager.num_free_blocks == 1

    roomy = Scheduler(make_config(num_speculative_tokens=3, num_blocks=8, max_num_batched_tokens=16))
    (a,) = _decoding_seqs(roomy, ([5, 6, 7, 5, 6], 7), max_tokens=20)
    roomy.schedule()
    assert a.spec_token_ids == [5, 6, 7]  # a third block, with 5 free for 1 running sequence


def test_draft_slots_are_not_offered_to_the_prefix_cache():
    """Blocks are registered only as far as the sequence's own tokens: a block that only a draft
    fills (which may yet be rejected) stays out of the cache."""
    sched = Scheduler(make_config(num_speculative_tokens=3, enable_prefix_caching=True))
    seq = _decoding_seq(sched, [5, 6, 7, 8, 5, 6, 7, 8], max_tokens=20)  # 9 tokens: 2 full blocks + 1
    sched.schedule()
    assert len(seq.spec_token_ids) == 3  # positions 8..11 are computed: a third "full" block
    assert len(seq.block_table) == 3
    assert seq.num_registered_blocks == 2
    assert len(sched.block_manager.cached) == 2


def test_ineligible_requests_get_no_draft():
    seq = Sequence(Request("r", None, [1, 2, 1], SamplingParams(temperature=0.7)), 0, [1, 2, 1], None)
    assert not NgramProposer.eligible(seq)
    for params in (dict(logprobs=2), dict(repetition_penalty=1.2), dict(min_tokens=5), dict(n=2),
                   dict(logit_bias={3: 1.0}), dict(allowed_token_ids=[1, 2]), dict(bad_words=["no"])):
        p = SamplingParams(temperature=0.0, **params)
        seq = Sequence(Request("r", None, [1, 2, 1], p), 0, [1, 2, 1], None)
        assert not NgramProposer.eligible(seq), params
    assert NgramProposer.eligible(Sequence(Request("r", None, [1], SamplingParams(temperature=0.0)), 0, [1], None))


def test_config_rejects_bad_speculative_options():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2)
    for bad, field in (({"method": "eagle", "num_speculative_tokens": 2}, "method"),
                       ({"method": "ngram"}, "num_speculative_tokens is required"),
                       ({"method": "ngram", "num_speculative_tokens": "4"}, "num_speculative_tokens"),
                       ({"method": "ngram", "num_speculative_tokens": 4, "model": "x"}, "unknown keys"),
                       ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 0}, "prompt_lookup_min")):
        with pytest.raises(ValueError, match=field):
            EngineConfig(speculative_config=bad)


def test_config_takes_vllms_speculative_config():
    cfg = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                           "prompt_lookup_min": 2})
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (5, 4, 2)


# ---- the engine, bundled model ----------------------------------------------------------------

PROMPTS = ["1, 2, 3, 1, 2, 3, 1, 2, 3,", "The cat sat on the mat. The cat sat on the mat. The cat",
           "def f(x):\n    return x\n\ndef g(x):\n    return x\n\ndef h(x):", "Hello, my name is"]


@pytest.fixture(scope="module")
def engines(bundled_dir):
    common = dict(dtype="float32", max_model_len=512, seed=0)
    return LLM(bundled_dir, **common), LLM(bundled_dir, num_speculative_tokens=4, **common)


@pytest.mark.slow
def test_output_with_drafts_equals_output_without(engines):
    plain, spec = engines
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    assert all(len(t) == 48 for t in got)
    sched = spec.llm_engine.scheduler
    assert sched.num_accepted_tokens > 0 and sched.num_draft_tokens >= sched.num_accepted_tokens
    sched.block_manager.check_invariants([])


@pytest.mark.slow
def test_bf16_output_with_drafts_equals_output_without_on_near_ties(bundled_dir, monkeypatch):
    """Random-token prompts, whose greedy continuations in bf16 are full of near-ties (logits a
    rounding apart): a verified draft position must compute what a decode step at that position
    computes, bit for bit, or the two runs part at the first near-tie. Contexts stay under 256
    tokens, where the decode kernel never splits a sequence; where this host's GEMM library rounds
    a row differently at different row counts (oneDNN on AMX: the LM head), every linear layer
    multiplies in fixed 8-row slices, as test_engine's pruned-layer test does."""
    vocab = 49152  # the bundled model's vocabulary
    g = torch.Generator().manual_seed(7)
    prompts = [{"prompt_token_ids": torch.randint(100, vocab, (int(n),), generator=g).tolist()}
               for n in torch.randint(16, 150, (16,), generator=g)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    common = dict(dtype="bfloat16", max_model_len=256, max_num_batched_tokens=512, seed=0)
    runs = {}
    for k in (0, 4):
        llm = LLM(bundled_dir, num_speculative_tokens=k, **common)
        if not k and _gemm_rows_depend_on_row_count(llm.llm_engine.runner.model, max_rows=96):
            _multiply_in_fixed_row_slices(monkeypatch)
        runs[k] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if k:
            assert llm.llm_engine.scheduler.num_accepted_tokens > 0, "no draft was accepted"
    assert runs[4] == runs[0]


def _step_through(llm, prompt, params):
    """Run one request step by step: its final completion and how many tokens the last step added."""
    e = llm.llm_engine
    e.add_request("stepped", prompt, params)
    final, last_delta = None, 0
    while e.has_unfinished_requests():
        for out in e.step():
            final, last_delta = out.outputs[0], len(out.outputs[0].delta_token_ids)
    return final, last_delta


@pytest.mark.slow
def test_stops_inside_an_accepted_draft(engines):
    """A stop token or string among a step's accepted tokens ends the output there, as without drafts."""
    plain, spec = engines
    base = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    ref = plain.generate(PROMPTS[0], base, use_tqdm=False)[0].outputs[0]
    last_deltas = []
    for j in (9, 17, 30):
        stop_tok = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[ref.token_ids[j]])
        stop_str = SamplingParams(temperature=0.0, max_tokens=40, stop=[ref.text[5 + j:8 + j]])
        for params in (stop_tok, stop_str):
            want = plain.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
            got, last_delta = _step_through(spec, PROMPTS[0], params)
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
                (want.token_ids, want.text, want.finish_reason, want.stop_reason)
            assert got.finish_reason == "stop"
            last_deltas.append(last_delta)
    # The case under test happened: some stop came in a step that kept several tokens.
    assert max(last_deltas) > 1, last_deltas


@pytest.mark.slow
def test_streamed_deltas_carry_every_accepted_token(engines):
    _, spec = engines
    e = spec.llm_engine
    e.add_request("s", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    deltas, text, final = [], "", None
    while e.has_unfinished_requests():
        for out in e.step():
            deltas.append(out.outputs[0].delta_token_ids)
            text += out.outputs[0].delta_text
            final = out
    assert [t for d in deltas for t in d] == final.outputs[0].token_ids
    assert text == final.outputs[0].text
    assert max(len(d) for d in deltas) > 1, "no step accepted a draft"
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 40
