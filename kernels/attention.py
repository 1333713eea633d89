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

import itertools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


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


# The one-byte cache dtypes (vLLM's kv_cache_dtype "fp8_e5m2", and "fp8" / "fp8_e4m3").
ONE_BYTE_DTYPES = (torch.float8_e5m2, torch.float8_e4m3fn)
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value


# An int8 cache's (token, kv head) row: head_dim int8 codes, then the row's float32 scale (4 bytes);
# the cache's last dim is head_dim + INT8_ROW_SCALE_BYTES.
INT8_ROW_SCALE_BYTES = 4
# Caches of codes that bf16 and float32 rows are written into (the C++ kernels' coded_dtype).
CODED_CACHE_DTYPES = (*ONE_BYTE_DTYPES, torch.int8)


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """Rows x [..., head_dim] (bf16 or float32) as an int8 cache stores them: [..., head_dim + 4]
    int8, each row's codes round(x * (127 / amax)) (nearest even; amax its largest magnitude) and
    then its scale amax / 127 as float32 bytes; a row of zeros (or with a NaN) gets scale 1 and
    codes round(x), NaN values code 0. The bytes Pagoda's C++ writers store."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    pos = amax > 0  # False for a NaN amax too
    one = torch.ones_like(amax)
    scale = torch.where(pos, amax / 127.0, one)
    inv = torch.where(pos, torch.full_like(amax, 127.0) / amax, one)  # (127.0 / amax would be reciprocal x 127)
    v = xf * inv
    codes = torch.where(v.isnan(), torch.zeros_like(v), v).clamp(-127, 127).round().to(torch.int8)
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def cache_row_elems(head_dim: int, cache_dtype: torch.dtype) -> int:
    """Elements of a (token, kv head) row in a cache of ``cache_dtype``: head_dim, and an int8
    cache's scale after its codes (the cache's last dim)."""
    return head_dim + (INT8_ROW_SCALE_BYTES if cache_dtype == torch.int8 else 0)


def cache_head_dim(cache: torch.Tensor) -> int:
    """A K/V cache's head_dim: its last dim, less an int8 cache's scale bytes."""
    return cache.shape[-1] - (INT8_ROW_SCALE_BYTES if cache.dtype == torch.int8 else 0)


def dequantize_int8_rows(rows: torch.Tensor) -> torch.Tensor:
    """An int8 cache's rows [..., head_dim + 4] -> their values [..., head_dim] float32 (codes x scale)."""
    codes, scale = rows[..., :-INT8_ROW_SCALE_BYTES], rows[..., -INT8_ROW_SCALE_BYTES:].contiguous()
    return codes.float() * scale.view(torch.float32)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows as a cache of ``dtype`` stores them: torch's conversion, where float8_e4m3fn (no
    infinities) saturates at +-448 first (torch's conversion alone gives NaN there), as vLLM's fp8
    writers do; an int8 cache's rows of codes and a scale (quantize_int8_rows). The codes Pagoda's
    C++ writers store."""
    if dtype == torch.int8:
        return quantize_int8_rows(x)
    if dtype == torch.float8_e4m3fn:
        x = x.clamp(-E4M3_MAX, E4M3_MAX)
    return x.to(dtype)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """reshape_and_cache: store each new token's K/V [T, kv_heads, head_dim] at its slot."""
    num_blocks, block_size, kvh, d = key_cache.shape
    key_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping, to_cache_dtype(key, key_cache.dtype))
    value_cache.view(num_blocks * block_size, kvh, d).index_copy_(0, slot_mapping,
                                                                  to_cache_dtype(value, value_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_blocks * block_size, kv_heads, head_dim]."""
    num_blocks, block_size, kvh, d = cache.shape
    b, nb = block_tables.shape
    flat = cache.view(num_blocks, block_size * kvh * d).index_select(0, block_tables.reshape(-1))
    return flat.view(b, nb * block_size, kvh, d)


class TorchAttention:
    """Reference/CPU attention from torch ops: gather K/V through the block tables, then attend."""

    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """reshape_and_cache: store each new token's K/V [T, kv_heads, head_dim] at its slot."""
        write_kv(key, value, key_cache, value_cache, slot_mapping)

    def reads_cache_dtype(self, cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
        """Whether decode and prefill attend a model of ``dtype`` on caches of ``cache_dtype``: here
        the model's own only."""
        return cache_dtype == dtype

    def prefill_reads_cache(self, dtype: torch.dtype) -> bool:
        """Whether ``prefill`` reads every key and value from the cache (its ``k`` / ``v`` arguments
        unused, so the caller may write them to the cache only and pass None). Not here: the torch
        path attends a first chunk to the k / v it is given."""
        return False

    def prefill_rows_independent(self, dtype: torch.dtype) -> bool:
        """Whether a prefill row's output has the same bits whichever other rows of its chunk the
        call has (the runner then runs the last layer on the sampled rows alone:
        ``ModelRunner.prune_last_layer``). Not here: SDPA takes its causal kernel for a whole first
        chunk and the masked one for that chunk's last row alone, and their bits differ."""
        return False

    def kernel_tensors(self, meta: AttentionMetadata, dtype: torch.dtype) -> tuple | None:
        """The C++ paged kernels' inputs for this step (CpuAttention), for a caller that runs them
        itself (``CpuLayerOps.decoder_layers``); None: this backend has no such kernels."""
        return None

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        if self.device.type != "cpu":  # the runner builds the metadata on the host
            for name in ("slot_mapping", "decode_block_tables", "decode_seq_lens", "prefill_block_tables"):
                setattr(meta, name, getattr(meta, name).to(self.device, non_blocking=True))
        cache = {}
        if meta.num_decode_tokens:
            nb = meta.decode_block_tables.shape[1]
            key_pos = torch.arange(nb * block_size, device=self.device)
            cache["decode_mask"] = key_pos[None, :] < meta.decode_seq_lens[:, None].long()
        if meta.num_prefills:
            qlens = meta.prefill_query_lens.tolist()
            seq_lens = meta.prefill_seq_lens.tolist()
            cache["prefill_chunks"] = [
                (q0, qlen, seq_len - qlen, seq_len, -(-seq_len // block_size))
                for q0, qlen, seq_len in zip(itertools.accumulate([0] + qlens[:-1]), qlens, seq_lens)]
            cache["prefill_masks"] = {}
        meta.cache = cache

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D] (written into ``out`` if given); one query per sequence."""
        bd, h, d = q.shape
        kvh = key_cache.shape[2]
        k = _gather(key_cache, meta.decode_block_tables)  # [Bd, L, kvh, D]
        v = _gather(value_cache, meta.decode_block_tables)
        qg = q.view(bd, kvh, h // kvh, d)
        scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [Bd, kvh, g, L]
        scores.masked_fill_(~meta.cache["decode_mask"][:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(q.dtype)
        # Slots past a sequence's end hold whatever the pool had: zero them so 0 * NaN cannot leak.
        v = v.masked_fill(~meta.cache["decode_mask"][:, :, None, None], 0)
        res = torch.matmul(probs, v.transpose(1, 2)).view(bd, h, d)
        return res if out is None else out.copy_(res)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q [Tp, H, D], k/v [Tp, kv_heads, D]: the prefill chunks back to back -> [Tp, H, D] (written
        into ``out`` if given).

        One fused SDPA call per prefilling sequence (a step has few: they share the token budget).
        A chunk with no earlier context attends to its own K/V with the causal kernel; a later
        chunk or a prefix-cache hit reads its context through the block table with a
        bottom-right-aligned causal mask (additive: a boolean mask is 2-3x slower on CPU).
        """
        if out is None:
            out = torch.empty_like(q)
        masks = meta.cache["prefill_masks"]
        for i, (q0, qlen, start, seq_len, nb) in enumerate(meta.cache["prefill_chunks"]):
            qi = q[q0:q0 + qlen].transpose(0, 1)[None]
            if start == 0:
                ki, vi = k[q0:q0 + qlen].transpose(0, 1)[None], v[q0:q0 + qlen].transpose(0, 1)[None]
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:
                table = meta.prefill_block_tables[i:i + 1, :nb]
                ki = _gather(key_cache, table)[:, :seq_len].transpose(1, 2)
                vi = _gather(value_cache, table)[:, :seq_len].transpose(1, 2)
                mask = masks.get((i, q.dtype))
                if mask is None:
                    pos = torch.arange(seq_len, device=q.device)
                    visible = pos[None, :] <= start + pos[:qlen, None]
                    mask = torch.zeros(qlen, seq_len, dtype=q.dtype, device=q.device).masked_fill_(~visible,
                                                                                                float("-inf"))
                    masks[(i, q.dtype)] = mask
                o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            out[q0:q0 + qlen] = o[0].transpose(0, 1)
        return out


def get_attention_backend(name: str, device: torch.device):
    """The attention implementation for ``name``: "cpu" (C++ paged kernels), "torch" (plain torch
    ops, the reference), "triton", or "auto" (the fastest one available on ``device``)."""
    if device.type == "cpu" and name in ("cpu", "auto"):
        try:
            from .cpu_attention import CpuAttention

            return CpuAttention()
        except Exception as e:  # no compiler or build failure: still serve, slower
            if name == "cpu":
                raise
            logger.warning("C++ CPU attention unavailable (%s); using the torch implementation", e)
            return TorchAttention()
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from .triton_attention import TritonAttention

        return TritonAttention(device)
    if name == "torch":
        return TorchAttention(device)
    raise ValueError(f"attention_backend {name!r} is not available on {device.type}")
