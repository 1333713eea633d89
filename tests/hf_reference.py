"""transformers' own greedy decoding, the reference the engine's outputs are compared with."""
from __future__ import annotations

import inspect

import torch


def _cache_kwarg(model) -> str:
    # transformers 5.24 renamed the forward's KV cache argument (and its output) from
    # past_key_values to cache; the old name goes in 5.40.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_greedy_with_logits(model, prompt_ids: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding of one prompt with the model's own KV cache: the tokens and each step's fp32 logits."""
    name = _cache_kwarg(model)
    ids = torch.tensor([prompt_ids], device=model.device)
    cache, out, logits = None, [], []
    with torch.no_grad():
        for _ in range(max_new):
            res = model(input_ids=ids, use_cache=True, **{name: cache})
            cache = res[name]
            step_logits = res.logits[0, -1].float()
            nxt = int(step_logits.argmax())
            out.append(nxt)
            logits.append(step_logits)
            ids = torch.tensor([[nxt]], device=model.device)
    return out, logits


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding of one prompt with the model's own KV cache: the tokens."""
    return hf_greedy_with_logits(model, prompt_ids, max_new_tokens)[0]
