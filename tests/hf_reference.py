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


def hf_argmax_gaps(model, prompt_ids: list[int], token_ids: list[int]) -> tuple[list[int], list[float]]:
    """Teacher forcing: one forward of transformers over ``prompt_ids + token_ids``. For each of
    ``token_ids``: transformers' own argmax after the same prefix, and how far below its top logit
    the given token's logit lies (0 where the token is the argmax).

    Where every gap is 0, ``token_ids`` is exactly transformers' greedy decoding of the prompt (by
    induction over the positions), found in one forward instead of one per token."""
    ids = torch.tensor([prompt_ids + token_ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1].float()
    chosen = logits.gather(1, torch.tensor(token_ids, device=model.device)[:, None])[:, 0]
    top = logits.max(dim=1)
    return top.indices.tolist(), (top.values - chosen).tolist()
