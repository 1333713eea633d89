"""The bundled model, float32: 24+ prompts generated together under a KV budget that forces
chunked prefill and preemption, with and without speculative decoding, must equal transformers'
greedy decoding one prompt at a time.

Each output is checked by teacher forcing: one transformers forward over prompt + output gives,
at every position, transformers' argmax after the same prefix; where each token is that argmax,
the output is transformers' greedy decoding (by induction), at a forward a prompt instead of one a
token. A token that is not the argmax is accepted only where its logit is within 1e-4 of the top
one (a true tie), and it is printed; every later position is still checked against the prefix the
engine took.
"""
from __future__ import annotations

import pytest
import torch

from engine_service import LLM, SamplingParams
from tests.hf_reference import hf_argmax_gaps

MAX_NEW = 32
TIE = 1e-4

PLAIN = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Q: What is 17 times 23?\nA:",
    "import numpy as np\n\n# Compute the mean of a list\n",
    "La Tour Eiffel est",
    "The most important thing about distributed systems is",
    "1, 1, 2, 3, 5, 8,",
    "Write a haiku about autumn:\n",
    "In 1969, the first humans",
]
CHAT = [
    "What is the capital of France?",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for writing clean code.",
    "Translate 'good morning' into Spanish.",
    "What is 2 + 2?",
    "Write a short poem about the ocean.",
    "Summarize the plot of Romeo and Juliet.",
    "How do I reverse a list in Python?",
]
LONG_CONTEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; later, stored programs made software a thing of its own. Assembly gave way "
    "to high-level languages, operating systems hid the hardware, and networks joined machines "
    "into systems larger than any one of them. Each layer let people think about bigger problems "
    "while trusting the layers below. "
)


def build_prompts(tokenizer) -> list[list[int]]:
    prompts = [tokenizer.encode(p) for p in PLAIN]
    for q in CHAT:
        text = tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    # Long prompts (beyond the step budget) must be chunked; two share a long prefix.
    prompts.append(tokenizer.encode(LONG_CONTEXT * 3 + "In short,"))
    prompts.append(tokenizer.encode(LONG_CONTEXT * 3 + "The next layer will be"))
    prompts.append(tokenizer.encode(LONG_CONTEXT * 2 + "Question: what hid the hardware? Answer:"))
    chat_long = [{"role": "user", "content": LONG_CONTEXT * 2 + "Summarize this in five words."}]
    prompts.append(tokenizer.encode(tokenizer.apply_chat_template(chat_long, tokenize=False, add_generation_prompt=True),
                                    add_special_tokens=False))
    return prompts


@pytest.mark.slow
def test_bundled_model_matches_transformers_greedy(bundled_dir):
    from transformers import AutoModelForCausalLM

    # 40 blocks x 16 tokens: far less than 24 x (prompt + 32) tokens, so sequences are preempted;
    # a 64-token step budget chunks every prompt longer than that. The second engine also verifies
    # speculative drafts (prompt lookup), up to 4 tokens a step.
    runs = {}
    for spec in (0, 4):
        llm = LLM(bundled_dir, dtype="float32", max_model_len=512, num_gpu_blocks_override=40, block_size=16,
                  max_num_batched_tokens=64, max_num_seqs=16, num_speculative_tokens=spec)
        prompts = build_prompts(llm.get_tokenizer())
        assert len(prompts) >= 24
        assert max(len(p) for p in prompts) > 64 * 2
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        engine = llm.llm_engine
        assert engine.scheduler.num_preemptions > 0, "the KV budget was meant to force preemption"
        if spec:
            assert engine.scheduler.num_accepted_tokens > 0, "no draft was accepted"
        runs[spec] = [o.outputs[0].token_ids for o in outputs]
        del llm, engine

    hf = AutoModelForCausalLM.from_pretrained(bundled_dir, dtype=torch.float32).eval()
    ties = {spec: [] for spec in runs}
    for i, prompt in enumerate(prompts):
        for spec, outs in runs.items():
            ours = outs[i]
            assert len(ours) == MAX_NEW
            ref, gaps = hf_argmax_gaps(hf, prompt, ours)
            for j, gap in enumerate(gaps):
                if gap == 0.0:
                    continue
                print(f"drafts {spec}, prompt {i}: new token {j} is {ours[j]}, transformers' argmax {ref[j]}, "
                      f"{gap:.2e} below it")
                assert gap < TIE, f"drafts {spec}, prompt {i} diverged at token {j} without a tie (gap {gap:.2e})"
                ties[spec].append((i, j))
    for spec, t in ties.items():
        assert len(t) <= 2, f"too many tie divergences with num_speculative_tokens={spec}: {t}"
