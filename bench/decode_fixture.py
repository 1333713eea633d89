"""Synthetic decode-attention inputs in SmolLM2's shapes (bf16), for the probes that time the C++
kernels outside the engine (bench/gemm_after_attention.py, bench/overlap_probe.py)."""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BLOCK_SIZE, KV_HEADS, HEADS, HEAD_DIM = 64, 3, 9, 64


def decode_inputs(batch: int, context: int, layers: int):
    """(caches, block_tables, seq_lens, q): `layers` (key, value) caches of random bf16 on huge pages
    as the engine's, `batch` sequences of `context` tokens each at random blocks, one query each."""
    import torch

    from engine_service.cpu_malloc import advise_huge_pages

    nblk = -(-context // BLOCK_SIZE)
    blocks = batch * nblk

    def cache():
        t = torch.empty(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
        advise_huge_pages(t)
        return t.copy_(torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM))

    caches = [(cache(), cache()) for _ in range(layers)]
    tables = torch.randperm(blocks).to(torch.int32).view(batch, nblk)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
    return caches, tables, lens, q


def packed_weight(n: int, k: int):
    """A random bf16 [n, k] weight in oneDNN's packed layout, as the engine's (``pack_cpu_weight``)."""
    import torch

    from engine_service.models.llama import pack_cpu_weight

    return pack_cpu_weight((torch.randn(n, k) * 0.05).bfloat16(), 256)


def linear(x, w):
    """x @ w.T for a ``packed_weight``."""
    from engine_service.models.llama import linear as model_linear

    return model_linear(x, w, packed=True)
