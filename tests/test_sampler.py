"""Sampler behaviour: greedy, seeded reproducibility, filters, temperature, penalties, logprobs."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_service.sampler import Sampler, SamplingBatch, make_generator
from engine_service.sampling_params import SamplingParams

EOS = 1
FILTER_SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_batch(params, prompts=None, outputs=None, generators=None) -> SamplingBatch:
    n = len(params)
    if generators is None:
        generators = [make_generator(p.seed) if p.seed is not None else None for p in params]
    return SamplingBatch(
        params=params,
        prompt_token_ids=prompts or [[] for _ in range(n)],
        output_token_ids=outputs or [[] for _ in range(n)],
        generators=generators,
    )


def sample_many(sampler, logits_row, params, draws) -> torch.Tensor:
    """`draws` independent samples of one row, as one batch of identical rows."""
    logits = logits_row.unsqueeze(0).expand(draws, -1).contiguous()
    return sampler(logits, make_batch([params] * draws)).sampled_token_ids


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "sampled a token of probability 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.fixture(autouse=True)
def _seed_global_rng():
    torch.manual_seed(0)


# Every test runs on the sampler's torch path and on the C++ kernels the engine takes on CPU
# (``CpuLayerOps.sample``: filters by selection, one uniform a row; ``CpuLayerOps.logprobs``), which
# must obey the same rules.
KERNEL: dict = {}


def new_sampler(vocab_size: int, eos_token_ids: set[int]) -> Sampler:
    return Sampler(vocab_size, eos_token_ids, **KERNEL)


@pytest.fixture(autouse=True, params=["torch", "cpu"])
def sampler_path(request):
    if request.param == "cpu":
        from pagoda_kernels.layer_ops import CpuLayerOps

        ops = CpuLayerOps()
        KERNEL.update(argmax=ops.argmax, sample=ops.sample, logprobs=ops.logprobs)
    yield request.param
    KERNEL.clear()


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_and_ignores_padded_columns():
    vocab, width = 50, 64
    logits = torch.randn(8, width)
    logits[:, vocab:] = 100.0  # padding columns must never win
    sampler = new_sampler(vocab, {EOS})
    out = sampler(logits, make_batch([SamplingParams(temperature=0.0)] * 8))
    assert out.sampled_token_ids.dtype == torch.int64
    assert torch.equal(out.sampled_token_ids, logits[:, :vocab].argmax(-1))
    assert out.sampled_logprobs is None and out.topk_token_ids is None and out.topk_logprobs is None


def test_greedy_on_bf16_logits_takes_the_first_of_tied_maxima():
    # The LM head hands the sampler bf16 logits: coarse values, so exact ties are common.
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(64, 300, generator=g) * 0.05).to(torch.bfloat16)
    top = logits.max()
    logits[:, [7, 150, 299]] = top  # three-way tie for the maximum in every row
    logits[5, 3] = top  # an earlier one in row 5
    out = new_sampler(300, {EOS})(logits, make_batch([SamplingParams(temperature=0.0)] * 64))
    expected = torch.full((64,), 7, dtype=torch.int64)
    expected[5] = 3
    assert torch.equal(out.sampled_token_ids, expected)
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))


def test_greedy_fast_path_does_no_other_work(monkeypatch):
    sampler = new_sampler(32, {EOS})
    for name in ("_apply_penalties", "_mask_stop_tokens", "_sample_random", "_sample_rows"):
        monkeypatch.setattr(Sampler, name, lambda *a, **k: pytest.fail("fast path did extra work"))
    monkeypatch.setattr(torch.Tensor, "log_softmax", lambda *a, **k: pytest.fail("computed logprobs"))
    logits = torch.randn(4, 32)
    out = sampler(logits, make_batch([SamplingParams(temperature=0.0, top_k=3, min_p=0.5)] * 4))
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))


def test_greedy_fast_path_equals_general_path():
    vocab = 40
    sampler = new_sampler(vocab, {EOS})
    logits = torch.randn(6, 48)
    fast = sampler(logits, make_batch([SamplingParams(temperature=0.0)] * 6)).sampled_token_ids
    # logprobs, a spent min_tokens and a random row all force the general path.
    params = [SamplingParams(temperature=0.0, logprobs=2, min_tokens=1) for _ in range(5)]
    params.append(SamplingParams(temperature=1.0))
    outputs = [[3]] * 6
    general = sampler(logits, make_batch(params, outputs=outputs)).sampled_token_ids
    assert torch.equal(general[:5], fast[:5])
    assert 0 <= general[5] < vocab


# ---------------------------------------------------------------- seeded sampling


def _seeded_run(seed: int, others: list[SamplingParams], row: int, steps: int = 12) -> list[int]:
    """Tokens of a seeded row over `steps` steps, sitting at `row` among `others`."""
    vocab = 100
    sampler = new_sampler(vocab, {EOS})
    base = torch.randn(steps, vocab, generator=torch.Generator().manual_seed(7))
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=seed)
    params = others[:row] + [target] + others[row:]
    gens = [make_generator(p.seed) if p.seed is not None else None for p in params]
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(params), vocab) * 3  # other rows' logits change every run
        logits[row] = base[step]
        out = sampler(logits, make_batch(params, generators=gens))
        tokens.append(int(out.sampled_token_ids[row]))
    return tokens


def test_seeded_rows_reproducible_whatever_the_batch():
    reference = _seeded_run(1234, [], row=0)
    batches = [
        ([SamplingParams(temperature=0.8)] * 3, 2),  # unseeded neighbours
        ([SamplingParams(temperature=0.0), SamplingParams(seed=99, top_k=5)], 1),
        ([SamplingParams(seed=5), SamplingParams(seed=6), SamplingParams(seed=7)], 3),  # all seeded
        ([SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=3)] * 4, 0),
        ([SamplingParams(), SamplingParams(seed=5), SamplingParams(top_k=9), SamplingParams(seed=6)], 1),
    ]
    for others, row in batches:
        torch.manual_seed(row + 17)  # the global RNG state must not matter either
        assert _seeded_run(1234, others, row) == reference


def test_different_seeds_give_different_tokens():
    runs = {tuple(_seeded_run(seed, [], row=0)) for seed in range(20)}
    assert len(runs) == 20


def test_seeded_first_tokens_follow_the_distribution():
    vocab, n_seeds = 6, 3000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2])
    sampler = new_sampler(vocab, {EOS})
    params = [SamplingParams(seed=s) for s in range(n_seeds)]
    out = sampler(logits.expand(n_seeds, -1), make_batch(params))
    counts = torch.bincount(out.sampled_token_ids, minlength=vocab)
    assert chi_square(counts, logits.softmax(-1)) < 20.5  # df=5, p=0.001


# ---------------------------------------------------------------- filters


def _allowed(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Reference allowed set (float64, boundaries resolved in the permissive direction)."""
    scaled = logits / p.temperature  # same float32 op as the sampler, so ties are the same
    probs = scaled.double().softmax(-1)
    ok = probs >= p.min_p * probs.max() * (1 - 1e-5)
    if p.top_k:
        ok &= (scaled.unsqueeze(0) > scaled.unsqueeze(1)).sum(1) < p.top_k
    kept = torch.where(ok, probs, torch.zeros_like(probs))
    kept = kept / kept.sum()
    mass_above = (kept.unsqueeze(0) * (kept.unsqueeze(0) > kept.unsqueeze(1))).sum(1)
    return ok & (mass_above < p.top_p + 1e-5)


filter_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 4.0),
    top_k=st.integers(0, 30),
    top_p=st.floats(1e-9, 1.0) | st.just(1.0),
    min_p=st.floats(0.0, 1.0) | st.just(0.0),
)


@FILTER_SETTINGS
@given(data=st.data(), vocab=st.integers(2, 24), params=st.lists(filter_params, min_size=1, max_size=3))
def test_filters_never_sample_outside_allowed_set(data, vocab, params):
    # Values a float step or two apart, and signed zeros, too: what a filter's ties and edges are made of.
    near = st.sampled_from([0.0, -0.0, 2.0 ** -24, -(2.0 ** -24), 1e-30, 4.5, 4.5 + 2.0 ** -21, 4.5 - 2.0 ** -21])
    values = data.draw(
        st.lists(st.floats(-20, 20) | st.just(float("-inf")) | near, min_size=vocab, max_size=vocab)
        .filter(lambda xs: any(x > float("-inf") for x in xs))
    )
    logits = torch.tensor(values, dtype=torch.float32)
    # Rows with different params interleaved in one batch, so per-row parameters must line up.
    draws = 48
    batch_params = [params[i % len(params)] for i in range(draws * len(params))]
    out = new_sampler(vocab, {EOS})(logits.expand(len(batch_params), -1), make_batch(batch_params))
    for j, p in enumerate(params):
        tokens = out.sampled_token_ids[j :: len(params)]
        allowed = _allowed(logits, p)
        assert allowed[tokens].all(), (p, tokens.tolist(), allowed.nonzero().flatten().tolist())


@pytest.mark.parametrize(
    "params, kept",
    [
        (SamplingParams(top_k=3), 3),
        (SamplingParams(top_k=2, temperature=0.5), 2),
        (SamplingParams(top_p=0.71), 3),  # 0.4 + 0.3 < 0.71: the third token is needed
        (SamplingParams(top_p=0.69), 2),
        (SamplingParams(min_p=0.2), 3),
        (SamplingParams(min_p=0.6), 2),
        (SamplingParams(top_k=4, top_p=0.85, min_p=0.1), 3),
        (SamplingParams(top_k=3, top_p=0.75), 2),  # top_p over the renormalised top 3: 0.7/0.9 > 0.75
    ],
    ids=["top_k3", "top_k2", "top_p3", "top_p2", "min_p3", "min_p2", "all3", "top_k_then_p2"],
)
def test_filters_keep_several_tokens_at_their_renormalised_odds(params, kept):
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.03, 0.02])
    # Every other row is a neighbour with a different top_k, so per-row k must be honoured.
    batch = make_batch([params, SamplingParams(top_k=5)] * 6000)
    tokens = new_sampler(6, {EOS})(probs.log().expand(12000, -1), batch).sampled_token_ids[::2]
    counts = torch.bincount(tokens, minlength=6)
    expected = (probs.log() / params.temperature).softmax(-1)
    expected[kept:] = 0
    assert (counts[:kept] > 0).all()
    assert chi_square(counts, expected / expected.sum()) < 16.3  # df<=2, p=0.001


def test_tiny_top_p_keeps_the_top_token():
    logits = torch.zeros(4, 1000)
    logits[:, 17] = 1e-3  # nearly uniform: float32 cumsum may end below 1 - top_p
    out = new_sampler(1000, {EOS})(logits, make_batch([SamplingParams(top_p=1e-9)] * 4))
    assert out.sampled_token_ids.tolist() == [17] * 4


def test_all_but_one_token_masked_samples_it_without_nan():
    logits = torch.full((5, 10), float("-inf"))
    logits[:, 7] = -3.0
    params = [
        SamplingParams(temperature=0.3, top_p=0.5, min_p=0.9, logprobs=2),
        SamplingParams(top_k=4),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=3),
        SamplingParams(temperature=2.0, repetition_penalty=1.5, frequency_penalty=1.0),
    ]
    out = new_sampler(10, {EOS})(logits, make_batch(params, outputs=[[7, 7]] * 5))
    assert out.sampled_token_ids.tolist() == [7] * 5
    assert out.sampled_logprobs[0] == 0.0


# ---------------------------------------------------------------- temperature


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature_frequencies_match_softmax(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = sample_many(new_sampler(8, {EOS}), logits, SamplingParams(temperature=temperature), 20000)
    counts = torch.bincount(tokens, minlength=8)
    assert chi_square(counts, (logits / temperature).softmax(-1)) < 24.3  # df=7, p=0.001


def test_temperature_does_not_modify_input_logits():
    logits = torch.randn(3, 16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.5, top_k=3, top_p=0.5, repetition_penalty=2.0, min_tokens=2)] * 3
    new_sampler(16, {EOS})(logits, make_batch(params, prompts=[[1, 2, 3]] * 3))
    assert torch.equal(logits, before)


# ---------------------------------------------------------------- penalties and min_tokens


def reference_penalties(logits, prompt, output, p: SamplingParams) -> torch.Tensor:
    out = logits.clone()
    for t in set(prompt) | set(output):
        out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        out[t] -= p.frequency_penalty * c + p.presence_penalty
    return out


penalty_params = st.builds(
    SamplingParams,
    temperature=st.just(0.0),
    repetition_penalty=st.sampled_from([1.0, 0.7, 1.3, 2.0]),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            penalty_params,
            st.lists(st.floats(-3, 3), min_size=12, max_size=12),
            st.lists(st.integers(0, 11), max_size=10),
            st.lists(st.integers(0, 11), max_size=10),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_penalties_match_reference(rows):
    vocab = 12
    sampler = new_sampler(vocab, {EOS})
    logits = torch.tensor([r[1] for r in rows], dtype=torch.float32)
    batch = make_batch([r[0] for r in rows], prompts=[r[2] for r in rows], outputs=[r[3] for r in rows])
    expected = torch.stack(
        [reference_penalties(logits[i], r[2], r[3], r[0]) for i, r in enumerate(rows)]
    )
    penalized = [i for i, r in enumerate(rows) if r[0].repetition_penalty != 1.0
                 or r[0].presence_penalty != 0.0 or r[0].frequency_penalty != 0.0]
    if penalized:
        got = sampler._apply_penalties(logits, batch, penalized)
        torch.testing.assert_close(got, expected)
    # Through the public API: greedy picks the argmax of the penalized logits (unless tied).
    tokens = sampler(logits, batch).sampled_token_ids
    top2 = expected.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert torch.equal(tokens[clear], expected.argmax(-1)[clear])


def test_repetition_penalty_counts_prompt_and_frequency_only_output():
    sampler = new_sampler(6, {EOS})
    logits = torch.tensor([[2.0, -2.0, 2.0, 2.0, -2.0, 2.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    batch = make_batch([p], prompts=[[0, 1]], outputs=[[2, 2, 4]])
    got = sampler._apply_penalties(logits, batch, [0])
    # 0,1: prompt (repetition only); 2: output x2; 4: output x1; 3,5: untouched.
    expected = torch.tensor([[1.0, -4.0, 1.0 - 1.0 - 0.25, 2.0, -4.0 - 0.5 - 0.25, 2.0]])
    torch.testing.assert_close(got, expected)


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    vocab = 10
    sampler = new_sampler(vocab, {EOS, 99})  # 99: beyond the vocabulary, must be ignored
    logits = torch.zeros(vocab)
    logits[[EOS, 4, 6]] = 30.0  # EOS, a stop_token_id and an engine-added stop id dominate
    p = SamplingParams(min_tokens=3, stop_token_ids=[4], ignore_eos=True)
    p.all_stop_token_ids.add(6)
    for temperature in (0.0, 1.0):
        p.temperature = temperature
        blocked = sampler(logits.expand(500, -1), make_batch([p] * 500, outputs=[[2, 3]] * 500))
        assert not torch.isin(blocked.sampled_token_ids, torch.tensor([EOS, 4, 6])).any()
        free = sampler(logits.expand(500, -1), make_batch([p] * 500, outputs=[[2, 3, 5]] * 500))
        assert torch.isin(free.sampled_token_ids, torch.tensor([EOS, 4, 6])).all()
    assert set(free.sampled_token_ids.tolist()) == {EOS, 4, 6}


def test_min_tokens_only_affects_its_own_row():
    logits = torch.zeros(2, 8)
    logits[:, EOS] = 5.0
    params = [SamplingParams(temperature=0.0, min_tokens=2), SamplingParams(temperature=0.0)]
    out = new_sampler(8, {EOS})(logits, make_batch(params))
    assert out.sampled_token_ids[0] != EOS and out.sampled_token_ids[1] == EOS


# ---------------------------------------------------------------- logit_bias, allowed_token_ids


def test_logit_bias_moves_greedy_and_random_rows_and_only_their_own():
    vocab = 40
    logits = torch.randn(6, vocab)
    target = int(logits[0].argmin())
    top = int(logits[3].argmax())
    params = [SamplingParams(temperature=0.0, logit_bias={target: 100.0}),  # the least likely becomes the argmax
              SamplingParams(temperature=0.0),                               # no bias: its own argmax
              SamplingParams(temperature=0.9, seed=3, logit_bias={target: 100.0}),
              SamplingParams(temperature=0.0, logit_bias={top: float("-inf")}),  # banned
              SamplingParams(temperature=0.0, logit_bias={5: 0.5, 7: -0.25}),
              SamplingParams(temperature=0.0, repetition_penalty=2.0, logit_bias={9: 3.0})]
    out = new_sampler(vocab, {EOS})(logits, make_batch(params, prompts=[[9]] * 6))
    got = out.sampled_token_ids.tolist()
    assert got[0] == target and got[2] == target and got[1] == int(logits[1].argmax())
    biased = logits[3].clone()
    biased[top] = float("-inf")
    assert got[3] == int(biased.argmax())
    expected = logits[4].clone()
    expected[5] += 0.5
    expected[7] -= 0.25
    assert got[4] == int(expected.argmax())
    # the bias first, then the repetition penalty on the biased logit (vLLM's order)
    row = logits[5].clone()
    row[9] += 3.0
    row[9] = row[9] / 2.0 if row[9] > 0 else row[9] * 2.0
    assert got[5] == int(row.argmax())
    assert out.sampled_logprobs is None


def test_allowed_token_ids_bound_every_row_that_has_them():
    vocab = 50
    logits = torch.randn(vocab) * 3
    allowed = [3, 17, 41]
    logits[allowed] = torch.tensor([1.0, 0.5, 2.0])  # each drawn at 1.5 often enough to be seen
    for params in (SamplingParams(temperature=0.0, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, allowed_token_ids=allowed),
                   SamplingParams(temperature=1.5, top_k=2, allowed_token_ids=allowed, logit_bias={41: -100.0})):
        drawn = sample_many(new_sampler(vocab, {EOS}), logits, params, 400)
        assert set(drawn.tolist()) <= set(allowed)
        if params.greedy:
            assert drawn.unique().tolist() == [allowed[int(logits[allowed].argmax())]]
        elif params.logit_bias:
            assert set(drawn.tolist()) == {3, 17}, "41 biased away, the other two kept by top_k"
        else:
            assert set(drawn.tolist()) == set(allowed)
    rows = torch.randn(2, vocab)
    out = new_sampler(vocab, {EOS})(rows, make_batch([SamplingParams(temperature=0.0, allowed_token_ids=[8]),
                                                      SamplingParams(temperature=0.0)]))
    assert out.sampled_token_ids.tolist() == [8, int(rows[1].argmax())]


def test_bias_leaves_logprobs_raw_and_the_input_untouched():
    vocab = 30
    logits = torch.randn(3, vocab).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(temperature=0.0, logprobs=2, logit_bias={4: 50.0}),
              SamplingParams(temperature=0.0, logprobs=2, allowed_token_ids=[6, 7]),
              SamplingParams(temperature=0.0, logprobs=2)]
    out = new_sampler(vocab, {EOS})(logits, make_batch(params))
    assert torch.equal(logits, before)
    assert out.sampled_token_ids[0] == 4 and out.sampled_token_ids[1] in (6, 7)
    raw = logits.float().log_softmax(-1)
    torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, out.sampled_token_ids.unsqueeze(1)).squeeze(1))
    assert torch.equal(out.topk_token_ids, raw.topk(2, dim=-1).indices)


def bad_words_params(sequences: list[list[int]], **kwargs) -> SamplingParams:
    """SamplingParams whose bad words are these token sequences (the engine fills them from the words)."""
    params = SamplingParams(bad_words=["(filled below)"], **kwargs)
    params.bad_words_token_ids = sequences
    return params


def test_bad_words_ban_a_sequences_last_token_only_where_the_output_ends_with_the_rest():
    vocab = 40
    logits = torch.randn(7, vocab)
    top = [int(r.argmax()) for r in logits]
    second = [int(r.topk(2).indices[1]) for r in logits]
    params = [bad_words_params([[top[0]]], temperature=0.0),                     # one token: always banned
              bad_words_params([[5, 9, top[1]]], temperature=0.0),               # output ends 5, 9: banned
              bad_words_params([[5, 9, top[2]]], temperature=0.0),               # ends 9, 5: allowed
              bad_words_params([[5, 9, top[3]]], temperature=0.0),               # output too short: allowed
              bad_words_params([[9, top[4]], [8, 1], [top[4], 2]], temperature=0.0),  # the first applies
              SamplingParams(temperature=0.0),                                   # no bad words
              bad_words_params([[top[6]]], temperature=0.0, logit_bias={top[6]: 100.0})]  # -inf + 100 stays out
    outputs = [[], [3, 5, 9], [3, 9, 5], [9], [1, 9], [9], []]
    out = new_sampler(vocab, {EOS})(logits, make_batch(params, outputs=outputs))
    got = out.sampled_token_ids.tolist()
    assert got == [second[0], second[1], top[2], top[3], second[4], top[5], second[6]]


def test_bad_words_hold_for_random_rows_and_leave_logprobs_raw():
    vocab = 20
    logits = torch.zeros(vocab)
    logits[[3, 4]] = 4.0  # with 3 banned after 7, a draw is almost always 4
    params = bad_words_params([[7, 3], [11]], temperature=1.0, seed=5, logprobs=1)
    batch = make_batch([params] * 300, outputs=[[7]] * 300)
    out = new_sampler(vocab, {EOS})(logits.expand(300, -1).contiguous(), batch)
    drawn = set(out.sampled_token_ids.tolist())
    assert 4 in drawn and not drawn & {3, 11}
    assert torch.allclose(out.topk_logprobs[:, 0], logits.log_softmax(-1)[3].expand(300))


@pytest.mark.parametrize("kwargs, message", [
    ({"logit_bias": {"3": 1.0}}, r"SamplingParams\.logit_bias must be a dict of token id"),
    ({"logit_bias": {3: float("nan")}}, r"logit_bias must be"),
    ({"logit_bias": {3: float("inf")}}, r"logit_bias must be"),
    ({"logit_bias": [3]}, r"logit_bias must be"),
    ({"allowed_token_ids": []}, r"SamplingParams\.allowed_token_ids must be a non-empty list"),
    ({"allowed_token_ids": [1, -2]}, r"allowed_token_ids must be"),
    ({"bad_words": ["ok", " "]}, r"SamplingParams\.bad_words must be a list of strings that are not empty or all"),
    ({"bad_words": [3]}, r"bad_words must be"),
    ({"bad_words": {"a": 1}}, r"bad_words must be"),
])
def test_bad_bias_params_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_of_raw_logits():
    vocab = 30
    logits = torch.randn(5, 32) * 4
    params = [
        SamplingParams(temperature=0.0, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, top_k=3, logprobs=1),
        SamplingParams(temperature=1.2, top_p=0.5, logprobs=0, seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0, frequency_penalty=1.0, min_tokens=3),
    ]
    out = new_sampler(vocab, {EOS})(logits, make_batch(params, outputs=[[0, 2, 2]] * 5))
    raw = logits[:, :vocab].log_softmax(-1)
    tokens = out.sampled_token_ids
    assert out.sampled_logprobs.dtype == torch.float32
    torch.testing.assert_close(out.sampled_logprobs, raw.gather(1, tokens.unsqueeze(1)).squeeze(1))
    # each sampled token's rank among the raw logits: 1 + how many are above it
    above = (logits[:, :vocab] > logits.gather(1, tokens.unsqueeze(1))).sum(-1)
    assert out.sampled_ranks.dtype == torch.int64 and torch.equal(out.sampled_ranks, above + 1)
    values, ids = raw.topk(5, dim=-1)
    assert out.topk_token_ids.shape == (5, 5) and out.topk_token_ids.dtype == torch.int64
    assert torch.equal(out.topk_token_ids, ids)
    torch.testing.assert_close(out.topk_logprobs, values)


def test_logprobs_zero_gives_only_the_sampled_logprob():
    logits = torch.randn(2, 16)
    out = new_sampler(16, {EOS})(logits, make_batch([SamplingParams(temperature=0.0, logprobs=0)] * 2))
    assert out.topk_token_ids.shape == (2, 0) and out.topk_logprobs.shape == (2, 0)
    expected = logits.log_softmax(-1).max(-1).values
    torch.testing.assert_close(out.sampled_logprobs, expected)


def test_no_logprobs_asked_gives_none_on_the_random_path():
    out = new_sampler(16, {EOS})(torch.randn(2, 16), make_batch([SamplingParams(top_k=2)] * 2))
    assert out.sampled_logprobs is None and out.topk_token_ids is None and out.topk_logprobs is None
