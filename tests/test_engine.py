"""Engine tests on a tiny random-weight Llama: greedy output equals transformers' however the
batch is scheduled (chunked, preempted, swapped, prefix-cached, forked), plus the request API."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine_service import LLM, EngineConfig, LLMEngine, RequestOutputKind, SamplingParams
from pagoda_kernels.cpu_attention import prefill_supported
from tests.hf_reference import hf_greedy


@pytest.fixture(scope="module")
def hf_tiny(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(100, 40000) for _ in range(70)]
    ps = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 90))] for _ in range(10)]
    # Shared prefixes exercise the prefix cache (70 = 1 full block of 64, the CPU default, or 4 of
    # 16, + a partial one).
    ps += [shared + [rng.randrange(100, 40000) for _ in range(rng.randint(0, 20))] for _ in range(4)]
    return ps


@pytest.fixture(scope="module")
def reference(hf_tiny, prompts) -> list[list[int]]:
    return [hf_greedy(hf_tiny, p, 24) for p in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

SCHEDULES = {
    "default": {},
    "chunked-prefill": {"max_num_batched_tokens": 24},
    "preempt-recompute": {"num_gpu_blocks_override": 14, "block_size": 16, "max_model_len": 128,
                          "max_num_batched_tokens": 48},
    "preempt-swap": {"num_gpu_blocks_override": 14, "block_size": 16, "max_model_len": 128, "preemption_mode": "swap",
                     "max_num_batched_tokens": 48},
    "block-size-16": {"block_size": 16},
    "no-prefix-cache": {"enable_prefix_caching": False, "max_num_seqs": 3},
    "block-size-32": {"block_size": 32},
    "torch-attention": {"attention_backend": "torch", "max_num_batched_tokens": 40},
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_transformers(tiny_llama_dir, prompts, reference, schedule):
    llm = LLM(tiny_llama_dir, dtype="float32", **SCHEDULES[schedule])
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} diverged under schedule {schedule}"
        assert out.outputs[0].finish_reason == "length"
    sched = llm.llm_engine.scheduler
    if schedule.startswith("preempt"):
        assert sched.num_preemptions > 0, "the KV budget was meant to force preemption"
    if schedule == "default":
        assert sum(o.num_cached_tokens for o in outputs) > 0, "shared prefixes should hit the prefix cache"
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks, "blocks leaked"


def test_n_greedy_forks_share_the_prompt_and_match(tiny_llama_dir, prompts, reference):
    """n > 1 forks after the prefill and copies the shared partial block on write: every greedy
    completion must still equal the single-sequence reference."""
    llm = LLM(tiny_llama_dir, dtype="float32")
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    for out, ref in zip(outputs, reference[:4]):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        for c in out.outputs:
            assert c.token_ids == ref
    bm = llm.llm_engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_forks_sample_their_prompts_last_row_beside_scored_rows(tiny_llama_dir, prompts):
    """A forking request (n = 2) that also asks for prompt logprobs: the step's hidden rows are its
    scored prompt positions and its last one, and both completions sample the last one. With a
    2-token prompt there are as many sampled rows as hidden rows, which a runner that took "as
    many rows as sampled" for "every row, in order" would get wrong (the first completion would
    continue from the first position)."""
    llm = LLM(tiny_llama_dir, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def greedy(p):
        return llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids

    # a prompt whose two positions predict different tokens, so the wrong row shows
    prompt = next(p[:2] for p in prompts if len(p) >= 2 and greedy(p[:1])[0] != greedy(p[:2])[0])
    forked = SamplingParams(n=2, prompt_logprobs=1, temperature=0.0, max_tokens=6, ignore_eos=True)
    two = llm.generate({"prompt_token_ids": prompt}, forked, use_tqdm=False)[0]
    assert [c.token_ids for c in two.outputs] == [greedy(prompt)] * 2
    assert len(two.prompt_logprobs) == 2


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama_dir, prompts):
    llm = LLM(tiny_llama_dir, dtype="float32")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = [{"prompt_token_ids": p} for p in prompts[1:6]]
    others = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    mixed = llm.generate(crowd[:2] + [{"prompt_token_ids": prompts[0]}] + crowd[2:],
                         [others, others, seeded, others, others, others], use_tqdm=False)
    assert mixed[2].outputs[0].token_ids == alone
    n2 = llm.generate([{"prompt_token_ids": prompts[0]}],
                      SamplingParams(n=2, temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True),
                      use_tqdm=False)[0]
    assert n2.outputs[0].token_ids == alone
    assert n2.outputs[1].token_ids != alone, "forked samples of a seeded request must differ"


def test_stop_conditions(tiny_llama_dir, prompts, reference):
    llm = LLM(tiny_llama_dir, dtype="float32")
    prompt, ref = {"prompt_token_ids": prompts[0]}, reference[0]
    tok = llm.get_tokenizer()
    # stop_token_ids: stops on (and keeps) the first occurrence of the token.
    stop_tok = ref[5]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    # min_tokens: the stop token is masked until min_tokens are out.
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, min_tokens=24,
                                              stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 24 and out.finish_reason == "length"
    # Stop strings cut the text exactly, and are left out unless asked for.
    full = tok.decode(ref, skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    cut = full.index(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                              include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == full[:cut + len(stop)]
    # EOS ends a sequence unless ignore_eos.
    eos = sorted(llm.llm_engine.eos_token_ids)[0]
    engine = llm.llm_engine
    engine.eos_token_ids.add(ref[3])
    try:
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref[:ref.index(ref[3]) + 1] and out.finish_reason == "stop"
    finally:
        engine.eos_token_ids.discard(ref[3])
    assert eos in engine.eos_token_ids


def test_step_api_streams_deltas_and_abort_frees_blocks(tiny_llama_dir, prompts, reference):
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32"))
    tok = engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], params)
    streamed = {f"r{i}": ([], "") for i in range(4)}
    steps = 0
    final = {}
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            ids, text = streamed[out.request_id]
            c = out.outputs[0]
            streamed[out.request_id] = (ids + c.delta_token_ids, text + c.delta_text)
            if out.finished:
                final[out.request_id] = out
        if steps == 5:
            aborted = engine.abort_request("r3")
            assert aborted[0].outputs[0].finish_reason == "abort"
    for i in range(3):
        ids, text = streamed[f"r{i}"]
        assert ids == reference[i] == final[f"r{i}"].outputs[0].token_ids
        assert text == final[f"r{i}"].outputs[0].text == tok.decode(reference[i], skip_special_tokens=True)
    assert "r3" not in final
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


def test_output_kinds_hand_out_the_same_completion(tiny_llama_dir, prompts, reference):
    """CUMULATIVE, DELTA and FINAL_ONLY requests batched together: each kind's outputs add up to the
    same tokens, text and logprobs; FINAL_ONLY hands out one output, at the end."""
    engine = LLMEngine(EngineConfig(model=tiny_llama_dir, dtype="float32"))
    tok = engine.tokenizer
    kinds = list(RequestOutputKind)
    for kind in kinds:
        for i in range(2):
            engine.add_request(f"{kind.name}-{i}", prompts[i],
                               SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2, n=2,
                                              output_kind=kind))
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    for i in range(2):
        want = reference[i][:12]
        cumulative = seen[f"CUMULATIVE-{i}"]
        assert len(cumulative) > 1 and cumulative[-1].finished and not any(o.finished for o in cumulative[:-1])
        final = cumulative[-1].outputs
        delta = seen[f"DELTA-{i}"]
        assert len(delta) == len(cumulative) and delta[-1].finished
        only = seen[f"FINAL_ONLY-{i}"]
        assert len(only) == 1 and only[0].finished
        for j in range(2):  # n=2 greedy: both completions are the reference
            assert final[j].token_ids == want and final[j].text == tok.decode(want, skip_special_tokens=True)
            assert len(final[j].logprobs) == 12
            ids = [t for o in delta for t in o.outputs[j].token_ids]
            assert ids == want == [t for o in delta for t in o.outputs[j].delta_token_ids]
            assert "".join(o.outputs[j].text for o in delta) == final[j].text
            assert [lp for o in delta for lp in o.outputs[j].logprobs] == final[j].logprobs
            assert delta[-1].outputs[j].cumulative_logprob == pytest.approx(final[j].cumulative_logprob)
            c = only[0].outputs[j]
            assert c.token_ids == c.delta_token_ids == want
            assert c.text == c.delta_text == final[j].text
            assert c.logprobs == c.delta_logprobs == final[j].logprobs
            assert c.cumulative_logprob == pytest.approx(final[j].cumulative_logprob)
            assert c.finish_reason == final[j].finish_reason == "length"
    # LLM.generate asks for FINAL_ONLY on its own copy: the caller's params are left as they were.
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(tiny_llama_dir, dtype="float32")
    out = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference[0][:12] and params.output_kind == RequestOutputKind.CUMULATIVE
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY
    for bad in (3, "final", True):
        with pytest.raises(ValueError, match=r"SamplingParams.output_kind must be a RequestOutputKind"):
            SamplingParams(output_kind=bad)


@pytest.mark.parametrize("onednn", [False, True], ids=["host-default", "onednn"])
def test_gemm_rows_are_padded_only_where_onednn_multiplies(tiny_llama_dir, prompts, onednn):
    """oneDNN builds a primitive per row count, so where it multiplies a step's GEMMs their rows
    are padded to a multiple of 8; Pagoda's GEMMs take any row count, so where they multiply a
    step's GEMMs it runs its rows as they are (a decode step of 3 sequences: 3 rows, not 8): on a
    CPU with AMX too, where oneDNN takes only the layers' GEMMs past ``gemm_max_rows`` rows (with
    the limit lowered to 2 the 3 rows are padded). Forcing oneDNN (``cpu_bf16_gemm`` and
    ``cpu_f32_gemm`` off) pads wherever it is available."""
    from engine_service.models.llama import Linear

    opts = {"cpu_bf16_gemm": False, "cpu_f32_gemm": False} if onednn else {}
    llm = LLM(tiny_llama_dir, dtype="bfloat16", **opts)
    model = llm.llm_engine.runner.model
    uses_onednn = (model.tied_lm_head_packed is not None
                   or any(isinstance(m, Linear) and m.packed_weight is not None for m in model.modules()))
    if onednn and not uses_onednn:
        pytest.skip("oneDNN's packed GEMM is not available in this torch build")

    def decode_rows() -> list[int]:
        rows = []
        hook = model.embed_tokens.register_forward_hook(lambda mod, args, out: rows.append(args[0].shape[0]))
        try:
            greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            out = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], greedy, use_tqdm=False)
        finally:
            hook.remove()
        assert all(len(o.outputs[0].token_ids) == 4 for o in out)
        return rows[-3:]  # the last three steps decode the three sequences together

    runner = llm.llm_engine.runner
    ours = runner.bf16_gemm or runner.f32_gemm  # (no AVX2: oneDNN multiplies everything)
    assert decode_rows() == ([3] * 3 if ours else [8] * 3 if uses_onednn else [3] * 3)
    ops = runner.layer_ops
    if ours and ops.gemm_max_rows is not None and uses_onednn:  # AMX: past the limit, oneDNN's
        limit = ops.gemm_max_rows
        ops.gemm_max_rows = 2
        try:
            assert decode_rows() == [8] * 3
        finally:
            ops.gemm_max_rows = limit


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_steps_take_the_argmax_inside_the_lm_head_with_the_same_tokens(tiny_llama_dir, prompts, dtype):
    """A step whose rows are all plain greedy takes its tokens from the LM head's GEMM
    (``greedy_tokens``: the logits are never written) where that runs on Pagoda's GEMM: the same
    tokens as the sampler's argmax of the logits; a step with any other row computes the logits."""
    llm = LLM(tiny_llama_dir, dtype=dtype, max_num_batched_tokens=64)
    model = llm.llm_engine.runner.model
    batch = [{"prompt_token_ids": p} for p in prompts]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    fused = []
    greedy_tokens = model.greedy_tokens

    def counted(hidden, vocab_size):
        tokens = greedy_tokens(hidden, vocab_size)
        fused.append(tokens is not None)
        return tokens

    model.greedy_tokens = counted
    got = [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
    model.greedy_tokens = lambda hidden, vocab_size: None  # the logits, then the sampler's argmax
    want = [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
    assert got == want
    # Ours: the bf16 GEMMs (AVX512-BF16 or AMX), or the float32 kernel (a float32 model, or a bf16
    # model's bf16 weights on a CPU without bf16 dot products).
    runner = llm.llm_engine.runner
    ours = runner.bf16_gemm or runner.f32_gemm
    assert fused and all(fused) == bool(ours) and any(fused) == bool(ours)
    # Logprobs (or any sampled row) in a step: that step computes the logits and counts nothing here.
    model.greedy_tokens = counted
    fused.clear()
    out = llm.generate(batch[0], SamplingParams(temperature=0, max_tokens=4, logprobs=1), use_tqdm=False)[0]
    assert not fused and len(out.outputs[0].logprobs) == 4 and out.outputs[0].token_ids == want[0][:4]


def test_bad_requests_fail_alone(tiny_llama_dir, prompts, reference):
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=200)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("e", [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len is 200"):
        engine.add_request("long", [5] * 200, GREEDY)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        engine.add_request("oov", [1, 2, 49152], GREEDY)
    with pytest.raises(ValueError, match=r"logprobs is 21, above this engine's max_logprobs \(20\)"):
        engine.add_request("lp", [1, 2], SamplingParams(logprobs=21))
    with pytest.raises(ValueError, match=r"prompt_logprobs is 21, above this engine's max_logprobs \(20\)"):
        engine.add_request("plp", [1, 2], SamplingParams(prompt_logprobs=21))
    for name, params in (("stop_token_ids", SamplingParams(stop_token_ids=[3, 49152])),
                         ("logit_bias", SamplingParams(logit_bias={2: 1.0, 49160: -1.0})),
                         ("allowed_token_ids", SamplingParams(allowed_token_ids=[49152]))):
        with pytest.raises(ValueError, match=rf"SamplingParams\.{name} contains 491\d\d, outside the vocabulary"):
            engine.add_request(name, [1, 2], params)
    assert not engine.has_unfinished_requests()
    batch = [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": [7] * 500}, {"prompt_token_ids": prompts[1]}, ""]
    outputs = llm.generate(batch, GREEDY, use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == reference[0]
    assert outputs[2].outputs[0].token_ids == reference[1]
    assert outputs[1].error and "max_model_len" in outputs[1].error and not outputs[1].outputs
    assert outputs[3].error and "empty" in outputs[3].error


def hf_greedy_transformed(model, prompt_ids: list[int], max_new: int, transform) -> list[int]:
    """Greedy decoding with transformers, ``transform(logits, output so far)`` applied to each
    step's fp32 logits."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new):
            logits = transform(model(torch.tensor([ids])).logits[0, -1].float(), ids[len(prompt_ids):])
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.parametrize("speculative", [0, 4])
def test_logit_bias_and_allowed_token_ids_match_transformers(tiny_llama_dir, hf_tiny, prompts, reference, speculative):
    """Greedy rows with a logit_bias or allowed_token_ids take the argmax of the biased / masked
    logits at every step, beside an unbiased row that is unchanged, with and without speculative
    decoding (which must leave such rows alone: its drafts are checked against the plain argmax)."""
    n = 10
    bias = {reference[0][2]: -4.0, 1000: 6.0, 77: float("-inf")}
    allowed = sorted({*reference[1][:6], 5, 1000, 4321})

    def with_bias(logits, _output):
        logits = logits.clone()
        for t, b in bias.items():
            logits[t] += b
        return logits

    def only_allowed(logits, _output):
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    want_bias = hf_greedy_transformed(hf_tiny, prompts[0], n, with_bias)
    want_allowed = hf_greedy_transformed(hf_tiny, prompts[1], n, only_allowed)
    assert want_bias != reference[0][:n] and want_allowed != reference[1][:n], "the bias must change the output"
    llm = LLM(tiny_llama_dir, dtype="float32", num_speculative_tokens=speculative)
    plain = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[2]}],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logit_bias=bias),
         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, allowed_token_ids=allowed), plain],
        use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == want_bias
    assert outputs[1].outputs[0].token_ids == want_allowed and set(want_allowed) <= set(allowed)
    assert outputs[2].outputs[0].token_ids == reference[2][:n]


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_llama_dir, prompts, reference):
    """The request runs on the prompt's last k tokens: the output of that shorter prompt, its
    prompt_token_ids the kept ones; -1 keeps max_model_len - 1, so an over-long prompt runs."""
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=128)
    long_prompt = [7, 8, 9] * 40 + prompts[0]
    k = len(prompts[0])
    out = llm.generate({"prompt_token_ids": long_prompt},
                       SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=k),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == prompts[0] and out.outputs[0].token_ids == reference[0][:8]
    too_long = [5, 6] * 100
    out = llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1),
                       use_tqdm=False)[0]
    assert out.error is None and out.prompt_token_ids == too_long[-127:] and len(out.outputs[0].token_ids) == 1
    short = llm.generate({"prompt_token_ids": prompts[1]},
                         SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=500),
                         use_tqdm=False)[0]
    assert short.prompt_token_ids == prompts[1] and short.outputs[0].token_ids == reference[1][:8]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="SamplingParams.truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=bad)


def contains_run(tokens: list[int], run: list[int]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


@pytest.mark.parametrize("speculative", [0, 4])
def test_bad_words_match_transformers_with_the_words_banned(tiny_llama_dir, hf_tiny, prompts, reference, speculative):
    """A greedy row with bad_words takes the argmax with each word's last token banned wherever its
    output ends with the word's other tokens (a one-token word: always), step by step as
    transformers does with that ban, and never generates a word's tokens in a row; a row without
    them is unchanged, with and without speculative decoding."""
    n = 12
    llm = LLM(tiny_llama_dir, dtype="float32", num_speculative_tokens=speculative)
    engine, tokenizer = llm.llm_engine, llm.get_tokenizer()

    def word_in(output: list[int], length: int) -> tuple[str, list[int]]:
        """A word whose token sequences (as the engine makes them) include a run of ``output``."""
        for i in range(1, n - length):
            run = output[i:i + length]
            word = tokenizer.decode(run)
            if word.strip() and run in engine.bad_words_token_ids([word]):
                return word, run
        raise AssertionError(f"no {length}-token run of {output} comes back from its text")

    two, two_run = word_in(reference[0], 2)
    one, one_run = word_in(reference[1], 1)
    banned = {0: engine.bad_words_token_ids([two, "hello world"]), 1: engine.bad_words_token_ids([one])}

    def ban(row):
        def transform(logits, output):
            logits = logits.clone()
            for s in banned[row]:
                if len(s) == 1 or output[len(output) - len(s) + 1:] == s[:-1] and len(output) >= len(s) - 1:
                    logits[s[-1]] = float("-inf")
            return logits
        return transform

    want = [hf_greedy_transformed(hf_tiny, prompts[row], n, ban(row)) for row in (0, 1)]
    assert want[0] != reference[0][:n] and want[1] != reference[1][:n], "the ban must change the output"
    outputs = llm.generate(
        [{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": prompts[1]}, {"prompt_token_ids": prompts[2]}],
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, bad_words=[two, "hello world"]),
         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, bad_words=one),
         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)], use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got[:2] == want and got[2] == reference[2][:n]
    assert not any(contains_run(got[0], s) for s in banned[0]) and one_run[0] not in got[1]


def test_bad_words_token_ids_take_each_word_as_it_stands_and_after_a_space(tiny_llama_dir):
    engine = LLM(tiny_llama_dir, dtype="float32").llm_engine
    tok = engine.tokenizer
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    assert engine.bad_words_token_ids(["Paris", "  big cat"]) == [enc("Paris"), enc(" Paris"), enc("big cat"),
                                                                   enc(" big cat")]
    assert enc("Paris") != enc(" Paris") and len(enc(" big cat")) == 2
    assert engine.bad_words_token_ids(["Paris", " Paris"]) == [enc("Paris"), enc(" Paris")]  # each sequence once
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words must be"):
        engine.add_request("bw", [1, 2], SamplingParams(bad_words=["\n"]))


def test_kv_budget_too_small_fails_at_startup(tiny_llama_dir):
    with pytest.raises(ValueError, match="KV cache too small.*needs 64 blocks"):
        LLM(tiny_llama_dir, dtype="float32", max_model_len=1024, block_size=16, kv_cache_memory_bytes=10_000)


def test_logprobs_match_transformers(tiny_llama_dir, hf_tiny, prompts, reference):
    llm = LLM(tiny_llama_dir, dtype="float32")
    out = llm.generate({"prompt_token_ids": prompts[2]},
                       SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    ids = torch.tensor([prompts[2] + out.token_ids])
    with torch.no_grad():
        logp = torch.log_softmax(hf_tiny(ids).logits[0].float(), -1)
    n = len(prompts[2])
    total = 0.0
    for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = logp[n - 1 + j]
        top = torch.topk(ref, 3)
        assert [t for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 99)][:3] == top.indices.tolist()
        assert entry[tok].logprob == pytest.approx(float(ref[tok]), abs=1e-4)
        total += entry[tok].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-5)
    # Each entry's decoded_token: the token's text on its own, as vLLM's Logprob carries it.
    tokenizer = llm.get_tokenizer()
    for entry in out.logprobs:
        assert len(entry) >= 3
        for tid, lp in entry.items():
            assert lp.decoded_token == tokenizer.convert_tokens_to_string([tokenizer.convert_ids_to_tokens(tid)])
    quiet = llm.generate({"prompt_token_ids": prompts[2]},
                         SamplingParams(temperature=0, max_tokens=2, logprobs=3, prompt_logprobs=1, detokenize=False),
                         use_tqdm=False)[0]
    assert all(lp.decoded_token is None for entry in quiet.outputs[0].logprobs + quiet.prompt_logprobs[1:]
               for lp in entry.values())


@pytest.mark.parametrize("schedule", ["default", "chunked-prefill", "preempt-recompute", "torch-attention"])
def test_prompt_logprobs_match_transformers(tiny_llama_dir, hf_tiny, prompts, reference, schedule):
    """Each prompt token's logprob (and rank) under the logits of the position before it, and the top
    k there, as transformers computes them, whether the prompt ran in one chunk or several, was
    preempted and recomputed, or shares a prefix the cache already holds (it is computed whole, so
    every position is scored); the completions are the same greedy tokens."""
    llm = LLM(tiny_llama_dir, dtype="float32", **SCHEDULES[schedule])
    batch = [{"prompt_token_ids": p} for p in prompts]
    if schedule == "default":  # the shared prefixes in the cache first
        llm.generate(batch[-2:], GREEDY, use_tqdm=False)
    ks = [i % 3 for i in range(len(prompts))]  # 0, 1, 2 top logprobs, in one batch
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, prompt_logprobs=k) for k in ks]
    outputs = llm.generate(batch, params, use_tqdm=False)
    for i, (out, p, k) in enumerate(zip(outputs, prompts, ks)):
        assert out.outputs[0].token_ids == reference[i]
        assert out.num_cached_tokens == 0
        scored = out.prompt_logprobs
        assert len(scored) == len(p) and scored[0] is None, (i, len(scored))
        if len(p) == 1:
            continue
        with torch.no_grad():
            logp = torch.log_softmax(hf_tiny(torch.tensor([p])).logits[0, :-1].float(), -1)
        for j, entry in enumerate(scored[1:], start=1):
            ref = logp[j - 1]
            got = entry[p[j]]
            assert got.logprob == pytest.approx(float(ref[p[j]]), abs=1e-4), (i, j)
            lo, hi = int((ref > got.logprob + 1e-4).sum()) + 1, int((ref > got.logprob - 1e-4).sum()) + 1
            assert lo <= got.rank <= hi, (i, j, got.rank, lo, hi)
            assert sorted(entry, key=lambda t: entry[t].rank)[:k] == ref.topk(k).indices.tolist(), (i, j)
            assert set(entry) <= {p[j], *ref.topk(k).indices.tolist()}
    if schedule == "preempt-recompute":
        assert llm.llm_engine.scheduler.num_preemptions > 0


_KERNELS_PROBE = """
import importlib.metadata, importlib.util, json
spec = importlib.util.find_spec("kernels")
import transformers.integrations.hub_kernels  # imports Hugging Face's `kernels` where it is installed
from transformers.utils import import_utils
try:
    hf_kernels = importlib.metadata.version("kernels")
except importlib.metadata.PackageNotFoundError:
    hf_kernels = None
print(json.dumps({"origin": spec and spec.origin, "hf_kernels": hf_kernels,
                  "available": import_utils.is_kernels_available()}))
"""


@pytest.mark.parametrize("cwd", [".", "bench"])
def test_kernels_folder_never_shadows_hugging_face_kernels(cwd):
    """Our kernels/ folder is a namespace portion imported as `pagoda_kernels`, and bench/ holds no
    `kernels` module, so `import kernels` from the repository root (pytest, `python -m
    engine_service`, the Docker image's /app) or from a bench script finds Hugging Face's package
    where transformers installed it (5.25+ imports it at start-up) and nothing usable where not."""
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _KERNELS_PROBE], cwd=root / cwd, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    origin = probe["origin"]  # None for a namespace package (our folder alone) or no `kernels` at all
    assert origin is None or {"site-packages", "dist-packages"} & set(Path(origin).parts), \
        f"`kernels` resolved to {origin}, not to an installed package"
    if probe["hf_kernels"] is None:
        assert not probe["available"], "transformers mistook Pagoda's kernels/ for Hugging Face's `kernels`"
    else:
        assert origin is not None and Path(origin).parent.name == "kernels", origin


def _logits_per_step(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], prune: bool):
    """Step ``llm`` through ``prompts``: every step's logits, the outputs, how many rows each
    step's last layer ran on, and whether each step had a prefill."""
    engine = llm.llm_engine
    runner = engine.runner
    runner.prune_last_layer = prune
    steps, last_rows, prefills = [], [], []
    model = runner.model
    compute_logits, forward = model.compute_logits, model.forward

    def recording_compute_logits(hidden):
        steps.append(compute_logits(hidden).clone())  # as computed, before the sampler sees it
        return steps[-1]

    def no_tokens(hidden, vocab_size):
        return None

    def recording_forward(input_ids, positions, kv_caches, meta, attn, ops=None, keep=None):
        # The last layer's rows (it may run in C++ with the others: LlamaForCausalLM.layer_stack).
        last_rows.append(input_ids.shape[0] if keep is None else keep.index.shape[0])
        prefills.append(meta.num_prefills > 0)
        return forward(input_ids, positions, kv_caches, meta, attn, ops, keep)

    # Every step through compute_logits: no argmax inside the LM head's GEMM for greedy-only steps.
    model.compute_logits, model.forward, model.greedy_tokens = recording_compute_logits, recording_forward, no_tokens
    try:
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), {"prompt_token_ids": p}, sp)
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                outputs[out.request_id] = [c.token_ids for c in out.outputs]
    finally:
        del model.compute_logits, model.forward, model.greedy_tokens
        runner.prune_last_layer = True
    return steps, outputs, last_rows, prefills


def _gemm_rows_depend_on_row_count(model, max_rows: int) -> bool:
    """Whether a GEMM row's result in this host's linear layers depends on how many rows the call
    has. oneDNN's AMX kernels block K differently for some row counts (on one Xeon, bf16 gate_up,
    down and LM head shapes at 40-512 rows against 8-32 and 1024+), so a row's bf16 roundings
    differ between batch sizes there."""
    for m in model.modules():
        w = getattr(m, "packed_weight", None)
        if w is None or not hasattr(m, "in_features"):
            continue
        x = torch.randn(max_rows, m.in_features, generator=torch.Generator().manual_seed(0)).to(m.weight.dtype)
        ref = m(x[:8])
        if any(not torch.equal(m(x[:rows])[:8], ref) for rows in range(16, max_rows + 1, 8)):
            return True
    return False


def _multiply_in_fixed_row_slices(monkeypatch) -> None:
    """Make every linear layer multiply its input 8 rows at a time (each slice a call of its own),
    so that a row's result no longer depends on the call's row count."""
    import engine_service.models.llama as llama

    linear = llama.linear

    def sliced(x, weight, bias=None, packed=False):
        if x.shape[0] <= 8:
            return linear(x, weight, bias, packed)
        return torch.cat([linear(x[i:i + 8], weight, bias, packed) for i in range(0, x.shape[0], 8)])

    monkeypatch.setattr(llama, "linear", sliced)


@pytest.mark.parametrize("model,dtype,backend", [("tiny", "float32", "auto"), ("tiny", "bfloat16", "auto"),
                                                ("bundled", "bfloat16", "auto"), ("tiny", "float32", "torch")])
def test_last_layer_on_sampled_rows_only_gives_the_same_logits(tiny_llama_dir, bundled_dir, prompts, model,
                                                               dtype, backend, monkeypatch):
    """The last layer runs attention, o_proj and MLP only on the rows that are sampled: every
    step's logits are bitwise those of the full last layer, with chunked prefill, decodes, forks
    (n = 2) and speculative decodes in the same steps. Only where the backend's prefill gives a
    row the same bits whatever other rows its chunk has (the C++ and Triton kernels): torch's
    SDPA path (the torch backend, and the C++ backend on a CPU without AVX2) runs the whole last
    layer, since its causal kernel for a whole chunk and its masked one for a last row alone differ.

    Where this host's GEMM library rounds a row differently at different row counts (oneDNN on
    AMX, see ``_gemm_rows_depend_on_row_count``), no two batchings are bitwise comparable; there
    both runs multiply in fixed 8-row slices, so what is compared is still every row the pruned
    layer keeps, its attention and its position, bit for bit."""
    llm = LLM(tiny_llama_dir if model == "tiny" else bundled_dir, dtype=dtype, max_num_batched_tokens=40,
              num_speculative_tokens=3, max_model_len=512, seed=0, enable_prefix_caching=False,
              attention_backend=backend)
    if _gemm_rows_depend_on_row_count(llm.llm_engine.runner.model, max_rows=48):
        _multiply_in_fixed_row_slices(monkeypatch)
    ps = [p * 3 for p in prompts[:6]]  # repeats give the prompt-lookup drafts matches
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if i % 3 else
              SamplingParams(temperature=0.8, n=2, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(ps))]
    want, want_out, full_rows, _ = _logits_per_step(llm, ps, params, prune=False)
    got, got_out, pruned_rows, _ = _logits_per_step(llm, ps, params, prune=True)
    runner = llm.llm_engine.runner
    if runner.attn.prefill_rows_independent(runner.dtype):
        assert sum(pruned_rows) < sum(full_rows) * 0.8, (pruned_rows, full_rows)
    else:
        assert backend == "torch" or not prefill_supported(runner.dtype)
        assert pruned_rows == full_rows, "the last layer was pruned on a prefill path whose rows are not independent"
    assert got_out == want_out
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(g, w), f"step {i}: logits differ"
    assert llm.llm_engine.scheduler.num_accepted_tokens > 0, "no speculative draft was verified"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompts_one_token_last_chunk_gives_the_unchunked_bits(tiny_llama_dir, dtype, monkeypatch):
    """A prompt's rows go through the prefill kernel however the prompt is chunked. A last chunk
    of one token (the step budget left one, or a prefix-cache hit covered all but one) must give
    the bits the whole prompt in one chunk gives: the decode kernel's roundings differ from the
    prefill kernel's, and in bf16 that flips near-ties (bench/RESULTS.md, thirty-third session)."""
    if not prefill_supported(getattr(torch, dtype)):
        pytest.skip("no C++ prefill kernel on this CPU (no AVX2): torch's SDPA path gives a chunk's rows "
                    "other bits than the whole prompt's")
    prompt = [(37 * j) % 40000 + 100 for j in range(129)]  # 2 blocks of 64 + 1 token
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    opts = dict(dtype=dtype, max_model_len=256, block_size=64, seed=0)

    def run(llm):
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in out.logprobs]

    whole_llm = LLM(tiny_llama_dir, max_num_batched_tokens=256, **opts)
    if _gemm_rows_depend_on_row_count(whole_llm.llm_engine.runner.model, max_rows=136):
        _multiply_in_fixed_row_slices(monkeypatch)
    whole = run(whole_llm)
    # The same prompt again: its two full blocks come from the prefix cache, one token is left.
    cached = run(whole_llm)
    assert whole_llm.llm_engine.scheduler.block_manager.prefix_hits == 128
    chunked = run(LLM(tiny_llama_dir, max_num_batched_tokens=64, enable_prefix_caching=False, **opts))  # 64 + 64 + 1
    assert chunked == whole
    assert cached == whole


_F32_GEMM = {"cpu_f32_gemm": True}
_BF16_ON_F32_GEMM = {"cpu_f32_gemm": True, "matmul_dtype": "float32"}


@pytest.mark.parametrize("model,dtype,forced,pad", [
    pytest.param("tiny", "float32", {}, None, id="tiny-float32"),
    pytest.param("tiny", "bfloat16", {}, None, id="tiny-bfloat16"),
    pytest.param("tiny", "bfloat16", {}, 8, id="tiny-bfloat16-padded"),
    pytest.param("bundled", "bfloat16", {}, None, id="bundled-bfloat16"),
    pytest.param("bundled", "float32", _F32_GEMM, None, id="bundled-float32-f32-gemm"),
    pytest.param("bundled", "bfloat16", _BF16_ON_F32_GEMM, None, id="bundled-bfloat16-f32-gemm")])
def test_decoder_layers_in_one_call_give_the_python_layers_logits(tiny_llama_dir, bundled_dir, prompts, model,
                                                                  dtype, forced, pad):
    """On CPU the decoder layers run in one C++ call a step (``LlamaForCausalLM.layer_stack``,
    ``CpuLayerOps.decoder_layers``): every step's logits are bitwise those of the Python layers,
    in steps mixing chunked prefill, decodes, speculative decodes, GEMM padding rows and the pruned
    last layer. Tiny float32 takes the host's default (our float32 GEMMs where the CPU has AVX2 and
    FMA, else oneDNN), bfloat16 the host's default too: our bf16 GEMMs (tiny: head_dim 16, QKV then
    rotary; bundled: the fused QKV + rotary), or where the CPU has no bf16 dot products float32
    weights (activations widened, outputs rounded back) on our float32 GEMMs. Forced on every host
    with AVX2: our float32 GEMMs for the bundled model in float32, and in bfloat16 on float32
    weights (both with the fused QKV + rotary). Where our GEMMs have a row limit (AMX), the bundled
    model runs again with the limit lowered to 16 rows, so most steps take oneDNN's. Padded: the
    rows padded to a multiple of 8 as where oneDNN multiplies (on every host, so that the layers'
    padding rows are covered where all the GEMMs are ours and nothing pads)."""
    llm = LLM(tiny_llama_dir if model == "tiny" else bundled_dir, dtype=dtype, max_num_batched_tokens=40,
              num_speculative_tokens=3, max_model_len=512, seed=0, enable_prefix_caching=False, **forced)
    runner = llm.llm_engine.runner
    if pad:  # every GEMM input padded, whoever multiplies it
        runner.model.gemm_pad = lambda rows, lm_head=False: -rows % pad
    if forced:
        if not runner.layer_ops.f32_gemm:
            pytest.skip("this CPU has no AVX2 and FMA: no float32 GEMM of ours to force")
        assert runner.f32_gemm, "the float32 GEMMs did not run"
        # A bf16 model's own bf16 weights go to the float32 kernel (no float32 copies).
        assert runner.model.layers[0].mlp.gate_up_gemm.dtype == getattr(torch, dtype)
        # Its tied LM head too: the bf16 table as it is, or a float32 model's (greedy steps then take
        # their argmax inside it, as the bf16 GEMMs' do).
        assert runner.model.tied_lm_head_gemm is not None
        assert runner.model.tied_lm_head_gemm.dtype == getattr(torch, dtype)
    stack, ops = runner.model.layer_stack, runner.layer_ops
    assert stack is not None, "the decoder layers do not run in one call on this CPU"
    calls = []
    decoder_layers = ops.decoder_layers

    def counted(h, *args):
        calls.append(h.shape[0])
        return decoder_layers(h, *args)

    ops.decoder_layers = counted
    ps = [p * 3 for p in prompts[:6]]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) if i % 3 else
              SamplingParams(temperature=0.8, n=2, seed=i, max_tokens=12, ignore_eos=True) for i in range(len(ps))]
    limits = [ops.gemm_max_rows]
    if model == "bundled" and ops.gemm_max_rows is not None:
        limits.append(16)
    try:
        for limit in limits:
            ops.gemm_max_rows = limit
            runner.model.layer_stack = None
            want, want_out, _, _ = _logits_per_step(llm, ps, params, prune=True)
            assert not calls
            runner.model.layer_stack = stack
            got, got_out, forwards, prefills = _logits_per_step(llm, ps, params, prune=True)
            # Steps with a prefill run in Python where the CPU has no prefill kernel (no AVX2).
            in_one_call = len(forwards) if prefill_supported(getattr(torch, dtype)) else prefills.count(False)
            assert in_one_call and len(calls) == in_one_call, "a step ran its layers in Python"
            if pad:
                assert all(c % pad == 0 for c in calls), calls
            assert got_out == want_out
            assert len(got) == len(want)
            for i, (g, w) in enumerate(zip(got, want)):
                assert torch.equal(g, w), f"gemm_max_rows {limit}, step {i}: logits differ"
            if limit == 16:
                assert max(calls) > 16, "no step went past the lowered row limit"
            calls.clear()
    finally:
        del ops.decoder_layers
        ops.gemm_max_rows = limits[0]
        runner.model.layer_stack = stack


def test_kv_cache_dtype_is_checked_naming_the_option():
    """vLLM's kv_cache_dtype: 'auto', or one byte a value: 'fp8' and 'fp8_e4m3' (float8_e4m3fn) or
    'fp8_e5m2', or 'int8' (codes and a scale a row); other names are refused, and so is a one-byte
    cache for a float16 model or off the CPU."""
    assert EngineConfig().torch_kv_cache_dtype == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="fp8_e5m2").torch_kv_cache_dtype == torch.float8_e5m2
    assert EngineConfig(kv_cache_dtype="fp8").torch_kv_cache_dtype == torch.float8_e4m3fn
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").torch_kv_cache_dtype == torch.float8_e4m3fn
    assert EngineConfig(kv_cache_dtype="int8").torch_kv_cache_dtype == torch.int8
    for bad in ("fp8_e4m3fn", "uint8", "bfloat16"):
        with pytest.raises(ValueError, match=r"kv_cache_dtype must be 'auto' \(the model dtype\) or one of"):
            EngineConfig(kv_cache_dtype=bad)
    assert EngineConfig(kv_cache_dtype="int8", dtype="float32").torch_kv_cache_dtype == torch.int8
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs device 'cpu' and dtype 'bfloat16' or"):
        EngineConfig(kv_cache_dtype="int8", dtype="float16")
    assert EngineConfig(kv_cache_dtype="fp8_e5m2", dtype="float32").torch_kv_cache_dtype == torch.float8_e5m2
    with pytest.raises(ValueError, match="needs device 'cpu' and dtype 'bfloat16' or 'float32'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2", dtype="float16")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' needs device 'cpu'"):
        EngineConfig(kv_cache_dtype="fp8_e5m2", device="cuda")


def test_the_cpu_kv_budget_is_the_argument_else_pagoda_kv_cache_memory_bytes_else_4_gib(monkeypatch, tiny_llama_dir):
    """kv_cache_memory_bytes where given; where not, ``$PAGODA_KV_CACHE_MEMORY_BYTES`` (the variable
    ``serve`` reads for its option, so the library, the batch job and the service take one setting),
    else 4 GiB. A bad value is a ValueError naming the variable, and so is a budget from it that
    cannot hold one sequence."""
    from engine_service.config import KV_BUDGET_ENV

    def blocks(**kw):
        config = EngineConfig(max_model_len=512, block_size=64, **kw)
        config.finalize(8192, 1 << 20)  # 1 MiB a block
        return config.num_kv_blocks

    monkeypatch.delenv(KV_BUDGET_ENV, raising=False)
    assert blocks() == 4096
    monkeypatch.setenv(KV_BUDGET_ENV, "96MiB")
    assert blocks() == 96
    assert blocks(kv_cache_memory_bytes=32 << 20) == 32 and blocks(num_gpu_blocks_override=20) == 20
    monkeypatch.setenv(KV_BUDGET_ENV, " 1.5GiB ")
    assert blocks() == 1536
    monkeypatch.setenv(KV_BUDGET_ENV, "201326592")
    assert blocks() == 192
    for bad in ("lots", "-1G", "1..5G", "0"):
        monkeypatch.setenv(KV_BUDGET_ENV, bad)
        with pytest.raises(ValueError, match=f"^{KV_BUDGET_ENV}"):
            blocks()
    monkeypatch.setenv(KV_BUDGET_ENV, "4MiB")
    with pytest.raises(ValueError, match=r"KV cache too small: 4 blocks .* raise kv_cache_memory_bytes "
                                         r"\(PAGODA_KV_CACHE_MEMORY_BYTES=4MiB here\)"):
        blocks()
    # The offline API's engine sizes its cache by it (tiny model: 2 layers, 2 kv heads of 16, float32).
    monkeypatch.setenv(KV_BUDGET_ENV, "3MiB")
    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256)
    per_block = 2 * 2 * 64 * 2 * 16 * 4
    assert llm.llm_engine.config.num_kv_blocks == (3 << 20) // per_block
    cache = llm.llm_engine.runner.kv_cache
    assert cache.numel() * cache.element_size() == (3 << 20) // per_block * per_block


def _check_one_byte_cache_against(fp8, ref, prompts, ratio, f8):
    """fp8 (a one-byte kv_cache_dtype, torch dtype f8) against ref (the model dtype's cache), engines
    alike but for the cache: ``ratio`` times the blocks; after a prefill layer 0's K/V codes are
    bitwise torch's conversion of ref's (to_cache_dtype); each request's greedy tokens the same
    alone as in a batch. Returns the batch's tokens."""
    from pagoda_kernels.attention import to_cache_dtype

    r8, rr = fp8.llm_engine.runner, ref.llm_engine.runner
    assert r8.kv_cache.dtype == f8 and rr.kv_cache.dtype == ref.llm_engine.config.torch_dtype
    assert fp8.llm_engine.config.num_kv_blocks // ratio == ref.llm_engine.config.num_kv_blocks  # (budget // bytes)
    one = SamplingParams(temperature=0, max_tokens=1)
    for llm in (fp8, ref):
        llm.generate({"prompt_token_ids": prompts[0] * 2}, one, use_tqdm=False)
    n = rr.kv_cache.shape[2]
    got = r8.kv_cache[0, :, :n].view(torch.uint8)
    assert got.any() and torch.equal(got, to_cache_dtype(rr.kv_cache[0], f8).view(torch.uint8))
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:5]]
    together = [o.outputs[0].token_ids for o in fp8.generate(batch, greedy, use_tqdm=False)]
    alone = [fp8.generate(b, greedy, use_tqdm=False)[0].outputs[0].token_ids for b in batch]
    assert together == alone and all(len(t) == 10 for t in together)
    return together


ONE_BYTE_CACHES = [pytest.param("fp8_e5m2", torch.float8_e5m2, id="e5m2"),
                   pytest.param("fp8", torch.float8_e4m3fn, id="e4m3")]


@pytest.mark.parametrize("kv_cache_dtype,f8", ONE_BYTE_CACHES)
def test_one_byte_kv_cache_holds_twice_the_tokens_and_each_rows_own_tokens(bundled_dir, prompts, kv_cache_dtype, f8):
    """kv_cache_dtype "fp8_e5m2" or "fp8" (e4m3): the cache holds float8_e5m2 or float8_e4m3fn
    codes, twice the blocks a budget holds; after a prefill its layer-0 K/V (the same inputs in both
    engines) are bitwise torch's conversion of a bf16 engine's, through the engine's own writers
    (the QKV GEMM's epilogue in the one-call layer stack); a request's greedy tokens are the same
    alone as in a batch with chunked prefill beside decodes and with prompt-lookup drafts. Where the
    CPU cannot read such a cache (neither AVX512-BF16 nor an AVX2 build) the engine refuses it,
    naming the option."""
    from pagoda_kernels.cpu_attention import decode_supports_f8

    opts = dict(kv_cache_memory_bytes=64 << 20, max_model_len=1024, enable_prefix_caching=False, seed=0)
    if not decode_supports_f8():
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{kv_cache_dtype}' needs Pagoda's C\\+\\+ attention"):
            LLM(bundled_dir, kv_cache_dtype=kv_cache_dtype, **opts)
        return
    fp8 = LLM(bundled_dir, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=48, **opts)
    assert fp8.llm_engine.runner.model.layer_stack is not None  # the one-call layers write and read the codes
    together = _check_one_byte_cache_against(fp8, LLM(bundled_dir, max_num_batched_tokens=48, **opts), prompts, 2,
                                             f8)
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:5]]
    drafted = LLM(bundled_dir, kv_cache_dtype=kv_cache_dtype, num_speculative_tokens=3, **opts)
    assert [o.outputs[0].token_ids for o in drafted.generate(batch, greedy, use_tqdm=False)] == together


@pytest.mark.parametrize("kv_cache_dtype,f8", ONE_BYTE_CACHES)
def test_one_byte_kv_cache_for_a_float32_model(bundled_dir, prompts, kv_cache_dtype, f8):
    """A float32 model's one-byte cache: four times the blocks of its float32 budget; after a
    prefill its layer-0 K/V are bitwise torch's conversion of a float32 engine's; a request's greedy
    tokens are the same alone as in a batch with chunked prefill beside decodes. Where the build
    cannot read such a cache with float32 queries (AVX-512 and AVX2 builds can) the engine refuses it."""
    from pagoda_kernels.cpu_attention import decode_supports_f8

    opts = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=1024, enable_prefix_caching=False,
                seed=0, max_num_batched_tokens=48)
    if not decode_supports_f8(torch.float32):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{kv_cache_dtype}' needs Pagoda's C\\+\\+ attention"):
            LLM(bundled_dir, kv_cache_dtype=kv_cache_dtype, **opts)
        return
    _check_one_byte_cache_against(LLM(bundled_dir, kv_cache_dtype=kv_cache_dtype, **opts), LLM(bundled_dir, **opts),
                                  prompts, 4, f8)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_int8_kv_cache_holds_its_rows_codes_and_scales_and_each_rows_own_tokens(bundled_dir, prompts, dtype):
    """kv_cache_dtype "int8": each (token, kv head) row as 64 int8 codes and a float32 scale (68 bytes
    against bf16's 128 and float32's 256: that many more blocks a budget holds); after a prefill its
    layer-0 rows are bitwise quantize_int8_rows of a model-dtype engine's K/V, through the engine's
    own writers (the QKV GEMM's epilogue in the one-call layer stack); a request's greedy tokens are
    the same alone as in a batch with chunked prefill beside decodes and with prompt-lookup drafts.
    Where the build cannot read such a cache with the model's dtype the engine refuses it, naming
    the option."""
    from pagoda_kernels.attention import quantize_int8_rows
    from pagoda_kernels.cpu_attention import decode_supports_int8

    opts = dict(dtype=dtype, kv_cache_memory_bytes=64 << 20, max_model_len=1024, enable_prefix_caching=False, seed=0)
    if not decode_supports_int8(getattr(torch, dtype)):
        with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs Pagoda's C\\+\\+ attention"):
            LLM(bundled_dir, kv_cache_dtype="int8", **opts)
        return
    i8 = LLM(bundled_dir, kv_cache_dtype="int8", max_num_batched_tokens=48, **opts)
    ref = LLM(bundled_dir, max_num_batched_tokens=48, **opts)
    r8, rr = i8.llm_engine.runner, ref.llm_engine.runner
    assert r8.model.layer_stack is not None and r8.kv_cache.dtype == torch.int8 and r8.kv_cache.shape[-1] == 68
    assert i8.llm_engine.config.num_kv_blocks == (64 << 20) // (2 * 30 * 64 * 3 * 68)
    row = 128 if dtype == "bfloat16" else 256
    assert ref.llm_engine.config.num_kv_blocks == (64 << 20) // (2 * 30 * 64 * 3 * row)
    one = SamplingParams(temperature=0, max_tokens=1)
    for llm in (i8, ref):
        llm.generate({"prompt_token_ids": prompts[0] * 2}, one, use_tqdm=False)
    n = rr.kv_cache.shape[2]
    written = rr.kv_cache[0].ne(0).any(-1)  # [2, n, block_size, kv_heads]: the slots the prefill wrote
    got = r8.kv_cache[0, :, :n]
    assert written.sum() >= 2 * 2 * len(prompts[0]) * 3
    assert torch.equal(got[written], quantize_int8_rows(rr.kv_cache[0][written]))
    assert not got[~written].any()
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts[:5]]
    together = [o.outputs[0].token_ids for o in i8.generate(batch, greedy, use_tqdm=False)]
    alone = [i8.generate(b, greedy, use_tqdm=False)[0].outputs[0].token_ids for b in batch]
    assert together == alone and all(len(t) == 10 for t in together)
    drafted = LLM(bundled_dir, kv_cache_dtype="int8", num_speculative_tokens=3, **opts)
    assert [o.outputs[0].token_ids for o in drafted.generate(batch, greedy, use_tqdm=False)] == together


@pytest.mark.parametrize("kv_cache_dtype,cache_dtype,row", [("fp8_e5m2", torch.float8_e5m2, 64),
                                                             ("int8", torch.int8, 68)], ids=["e5m2", "int8"])
def test_one_byte_kv_cache_swaps_out_and_back_as_its_codes(bundled_dir, prompts, kv_cache_dtype, cache_dtype, row):
    """With preemption_mode="swap" a one-byte cache's blocks go to host memory and back as their
    codes (the swap space in the cache's dtype; an int8 cache's rows with their scales): a pool of 5
    blocks preempts the batch many times, and every request's greedy tokens are what it gets alone.
    (Recompute regenerates K/V through the prefill kernel, whose bits differ from decode's now and
    then, and a one-byte code can round the other way: such a request may continue differently, as
    with any lossy cache.)"""
    from pagoda_kernels.cpu_attention import decode_supports_f8, decode_supports_int8

    opts = dict(kv_cache_dtype=kv_cache_dtype, max_model_len=256, max_num_batched_tokens=64, seed=0)
    block = 2 * 30 * 64 * 3 * row  # bytes of one block of the bundled model's codes
    if not (decode_supports_int8() if cache_dtype == torch.int8 else decode_supports_f8()):
        with pytest.raises(ValueError, match=f"kv_cache_dtype '{kv_cache_dtype}' needs"):
            LLM(bundled_dir, preemption_mode="swap", kv_cache_memory_bytes=5 * block, **opts)
        return
    swapping = LLM(bundled_dir, preemption_mode="swap", kv_cache_memory_bytes=5 * block, **opts)
    assert swapping.llm_engine.runner.swap_cache.dtype == cache_dtype
    greedy = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    batch = [{"prompt_token_ids": p[:70]} for p in prompts[:4]]
    got = [o.outputs[0].token_ids for o in swapping.generate(batch, greedy, use_tqdm=False)]
    assert swapping.llm_engine.scheduler.num_preemptions > 0
    roomy = LLM(bundled_dir, **opts)
    assert got == [roomy.generate(b, greedy, use_tqdm=False)[0].outputs[0].token_ids for b in batch]
