"""Paged attention over a ragged batch: the interface the model runner calls, and the torch path.

The batch of one step is flattened: ``T`` new tokens, the first ``num_decode_tokens`` of them
decodes (one token per sequence), the rest the query chunks of prefilling sequences. Each layer
first writes the new tokens' K/V into their cache slots (``slot_mapping``), then attends: every
query reads its sequence's K/V through the sequence's block table, so a chunk sees the tokens
cached by earlier chunks and by prefix-cache hits.

KV cache layout, per layer: ``key_cache`` and ``value_cache`` of shape
``[num_blocks, block_size, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once by the model runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32: context length including the new token
    num_prefills: int
    prefill_query_lens: torch.Tensor  # [Bp] int64
    prefill_seq_lens: torch.Tensor  # [Bp] int64: context length after this chunk
    prefill_block_tables: torch.Tensor  # [Bp, max_blocks] int32
    max_prefill_query_len: int = 0
    max_prefill_seq_len: int = 0
    max_decode_seq_len: int = 0
    # Filled by the backend's prepare(): derived index/mask tensors reused by every layer.
    cache: dict | None = None


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """reshape_and_cache: store each new token's K/V [T, kv_heads, head_dim] at its slot."""
    num_blocks, block_size, kvh, d = key_cache.shape
    key_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, key)
    value_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, value)


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_blocks * block_size, kv_heads, head_dim]."""
    num_blocks, block_size, kvh, d = cache.shape
    b, nb = block_tables.shape
    flat = cache.view(num_blocks, block_size * kvh * d).index_select(0, block_tables.reshape(-1))
    return flat.view(b, nb * block_size, kvh, d)


class TorchAttention:
    """Reference/CPU attention from torch ops: gather K/V through the block tables, then attend."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        cache = {}
        if meta.num_decode_tokens:
            nb = meta.decode_block_tables.shape[1]
            key_pos = torch.arange(nb * block_size)
            cache["decode_mask"] = key_pos[None, :] < meta.decode_seq_lens[:, None].long()
        if meta.num_prefills:
            nb = meta.prefill_block_tables.shape[1]
            maxq = meta.max_prefill_query_len
            qlens = meta.prefill_query_lens
            # Position of each padded query row; rows past a sequence's chunk are padding.
            start = (meta.prefill_seq_lens - qlens)[:, None]
            q_pos = start + torch.arange(maxq)[None, :]
            q_valid = torch.arange(maxq)[None, :] < qlens[:, None]
            key_pos = torch.arange(nb * block_size)
            # Causal over the whole context; padding rows see key 0 so softmax stays finite.
            mask = key_pos[None, None, :] <= q_pos[:, :, None]
            mask &= q_valid[:, :, None]
            mask[:, :, 0] = True
            cache["prefill_mask"] = mask[:, None]
            cache["prefill_pad_index"] = q_valid.reshape(-1).nonzero().squeeze(1)
        meta.cache = cache

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D]; one query per sequence."""
        bd, h, d = q.shape
        kvh = key_cache.shape[2]
        k = _gather(key_cache, meta.decode_block_tables)  # [Bd, L, kvh, D]
        v = _gather(value_cache, meta.decode_block_tables)
        qg = q.view(bd, kvh, h // kvh, d)
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [Bd, kvh, g, L]
        scores.masked_fill_(~meta.cache["decode_mask"][:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        return torch.matmul(probs, v.transpose(1, 2)).view(bd, h, d)

    def prefill(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [Tp, H, D] (the prefill chunks, back to back) -> [Tp, H, D]."""
        tp, h, d = q.shape
        bp, maxq = meta.num_prefills, meta.max_prefill_query_len
        pad_index = meta.cache["prefill_pad_index"]
        qp = q.new_zeros(bp * maxq, h, d)
        qp.index_copy_(0, pad_index, q)
        k = _gather(key_cache, meta.prefill_block_tables)
        v = _gather(value_cache, meta.prefill_block_tables)
        mask = meta.cache.get("prefill_bias")
        if mask is None or mask.dtype != q.dtype:
            # An additive mask keeps SDPA on its fused CPU kernel (a boolean one is 2-3x slower).
            mask = torch.zeros(meta.cache["prefill_mask"].shape, dtype=q.dtype)
            mask.masked_fill_(~meta.cache["prefill_mask"], float("-inf"))
            meta.cache["prefill_bias"] = mask
        out = F.scaled_dot_product_attention(
            qp.view(bp, maxq, h, d).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(bp * maxq, h, d).index_select(0, pad_index)


def get_attention_backend(name: str, device: torch.device):
    """The attention implementation for ``name`` ("torch" | "triton" | "auto")."""
    if name in ("torch", "auto") and device.type == "cpu":
        return TorchAttention()
    if name == "auto":
        name = "triton"
    raise ValueError(f"attention_backend {name!r} is not available on {device.type}")
