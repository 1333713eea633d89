"""Triton kernels for paged attention on GPU: the cache write, split-K decode and ragged prefill.

Three kernels behind the interface of ``attention.py`` (KV cache per layer
``[num_blocks, block_size, num_kv_heads, head_dim]``, K/V read through block tables):

- ``reshape_and_cache``: one program per new token copies its K and V rows into their slot
  (``slot_mapping``; a negative slot is skipped, vLLM's convention for padding tokens).
- ``paged_decode_attention``: one query token per sequence. Stage 1 runs one program per
  (sequence, kv head, context split); it loads the query rows of every q head sharing that kv
  head (GQA/MQA: the K/V tile is read once for the whole group, padded to 16 rows for ``tl.dot``)
  and attends over its slice of the context with an online softmax. With more than one split
  (flash-decoding, for long contexts or small batches) each split writes its normalised partial
  output and log-sum-exp, and stage 2 merges the splits.
- ``prefill_attention``: the prefill chunks of a step back to back (ragged, no padding). One
  program per (query tile, sequence, kv head): the tile's rows are (token, q head) pairs of the
  q heads sharing that kv head (GQA packing; a group larger than the tile takes several
  programs), so each K/V tile serves the whole group. It attends first to the context already in
  the paged cache (``seq_len - query_len`` tokens, no mask), then to the chunk's own K/V straight
  from the projection output with a bottom-right-aligned causal mask, applied per token (row r is
  token r // heads per program).

Head sizes that are not a power of two (80, 96) run in a power-of-two tile with masked lanes.
Accumulation is in float32. ``TRITON_INTERPRET=1`` (set before triton is imported) runs the same
programs on CPU tensors, which is how the tests check them on machines without a GPU. The
interpreter does arithmetic on bfloat16 as raw 16-bit integers, so under it bfloat16 operands are
widened to float32 before ``tl.dot`` (``UPCAST_DOT``); on a GPU the dots take bf16/fp16 operands
on the tensor cores, and float32 ones in IEEE precision (not TF32) so fp32 matches the reference.

Launch configurations and the bytes/FLOPs behind them: ``kernels/README.md``.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .attention import AttentionMetadata, TorchAttention

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Decode: context tokens per K/V tile, and the least context worth a split of its own.
DECODE_BLOCK_N = 64
DECODE_MIN_SPLIT_TOKENS = 256
DECODE_MAX_SPLITS = 64
DECODE_PROGRAMS_PER_SM = 2
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
# Prefill: key tile; the query tile is min(128, next_pow2(max_query_len * gqa_pack)) rows, at
# least 16, and 64 when 128-row tiles would give fewer than PREFILL_MIN_PROGRAMS_PER_SM programs
# per SM (measured on an H100: kernels/README.md).
PREFILL_BLOCK_N = 64
PREFILL_MAX_BLOCK_M = 128
PREFILL_MIN_PROGRAMS_PER_SM = 4


def interpreting() -> bool:
    """True when triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _dot_options(dtype: torch.dtype) -> tuple[bool, str]:
    """(UPCAST_DOT, DOT_PRECISION) for K/V of ``dtype``: see the module docstring."""
    upcast = dtype == torch.bfloat16 and interpreting()
    return upcast, "ieee" if dtype == torch.float32 or upcast else "tf32"


def _pow2(n: int, floor: int = 1) -> int:
    return max(floor, triton.next_power_of_2(max(1, int(n))))


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    KVH_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    page = slot // PAGE_SIZE
    offset = slot % PAGE_SIZE
    h = tl.arange(0, KVH_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(key_cache_ptr + page * stride_kcb + offset * stride_kcs + h * stride_kch + d, k, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(value_cache_ptr + page * stride_vcb + offset * stride_vcs + h * stride_vch + d, v, mask=mask)


@triton.jit
def _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale,
                 UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr = True):
    """One online-softmax step: q [M, D], k/v [N, D], valid [M, N]; scores in log2 units.
    ``MASKED=False`` (a tile every query row sees whole) skips applying ``valid``.

    Every caller's first tile has a valid key in each row, so m_i is finite from then on and
    exp2(m_i - m_new) never sees -inf - -inf.
    """
    if UPCAST_DOT:
        k = k.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)  # the PV product runs on the tensor cores in the cache dtype, like FlashAttention
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_paged_tile(key_cache_ptr, value_cache_ptr, table, n0, seq_len, kv_head, d, d_mask,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """K and V rows [BLOCK_N, D_PAD] of context tokens n0.. of one kv head, reached through the
    block table; tokens at or past ``seq_len`` and padded lanes read 0."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_mask = n < seq_len
    page = tl.load(table + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
    offset = n % PAGE_SIZE
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(key_cache_ptr + page[:, None] * stride_kcb + offset[:, None] * stride_kcs
                + kv_head * stride_kch + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + page[:, None] * stride_vcb + offset[:, None] * stride_vcs
                + kv_head * stride_vch + d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def _decode_stage1_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, mid_o_ptr, mid_lse_ptr, qk_scale,
    stride_qb, stride_qh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_ob, stride_oh,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
    GROUP: tl.constexpr, HEAD_BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    g = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = g < GROUP
    heads = kv_head * GROUP + g
    split = tl.program_id(2)
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM

    seq_len = tl.load(seq_lens_ptr + b)
    # Splits cover whole tiles; a short sequence leaves its last splits empty (stage 2 skips them).
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if NUM_SPLITS > 1:
        if start >= seq_len:  # nothing to write: stage 2 reads only the splits that got tokens
            return

    q_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        page = tl.load(table + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        offset = n % PAGE_SIZE
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(key_cache_ptr + page[:, None] * stride_kcb + offset[:, None] * stride_kcs
                    + kv_head * stride_kch + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(value_cache_ptr + page[:, None] * stride_vcb + offset[:, None] * stride_vcs
                    + kv_head * stride_vch + d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale,
                                     UPCAST_DOT, DOT_PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty range (seq_len 0, empty split) gives zeros
    o = acc / l_safe[:, None]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        tl.store(mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :],
                 o, mask=q_mask)
        tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, m_i + tl.log2(l_safe), mask=h_mask)


@triton.jit
def _decode_stage2_kernel(
    mid_o_ptr, mid_lse_ptr, seq_lens_ptr, out_ptr,
    stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s = tl.arange(0, SPLITS_PAD)
    s_mask = (s < NUM_SPLITS) & (s * split_len < seq_len)  # the splits stage 1 gave tokens to
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    o = tl.load(mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
                mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    den = tl.sum(w, 0)
    den = tl.where(den > 0, den, 1.0)
    o = tl.sum(o * w[:, None], 0) / den
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, cu_query_lens_ptr,
    seq_lens_ptr, out_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_ot, stride_oh,
    GROUP: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr,
    UPCAST_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    # A program owns BLOCK_T query tokens x PACK q heads of one kv head (GQA packing): row r of its
    # BLOCK_M-row tile is token r // PACK, q head r % PACK of the program's head block, so each K/V
    # tile it loads serves all PACK heads. PACK = 1 is one program per q head.
    # Last query tiles first: under the causal mask they have the most keys to read.
    mb = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    head0 = tl.program_id(2) * PACK
    kv_head = head0 // GROUP
    q_start = tl.load(cu_query_lens_ptr + b)
    q_len = tl.load(cu_query_lens_ptr + b + 1) - q_start
    q_lo = mb * BLOCK_T
    if q_lo >= q_len:
        return
    ctx_len = tl.load(seq_lens_ptr + b) - q_len

    r = tl.arange(0, BLOCK_M)
    m = q_lo + r // PACK  # the row's token in the chunk: the causal mask is per token
    heads = head0 + r % PACK
    m_mask = (r < BLOCK_T * PACK) & (m < q_len)
    rows = (q_start + m).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + rows[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)

    # 1. The context already cached (earlier chunks, prefix-cache hits): visible to every query.
    #    Whole tiles need no mask; only the last, partial one does.
    table = block_tables_ptr + b.to(tl.int64) * stride_bt
    ctx_full = (ctx_len // BLOCK_N) * BLOCK_N
    for n0 in range(0, ctx_full, BLOCK_N):
        k, v = _load_paged_tile(key_cache_ptr, value_cache_ptr, table, n0, ctx_len, kv_head, d, d_mask,
                                stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                                BLOCK_N, PAGE_SIZE)
        m_i, l_i, acc = _attend_tile(q, k, v, m_mask[:, None], m_i, l_i, acc, qk_scale,
                                     UPCAST_DOT, DOT_PRECISION, MASKED=False)
    for n0 in range(ctx_full, ctx_len, BLOCK_N):  # at most one: the partial tail tile
        k, v = _load_paged_tile(key_cache_ptr, value_cache_ptr, table, n0, ctx_len, kv_head, d, d_mask,
                                stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                                BLOCK_N, PAGE_SIZE)
        n_mask = n0 + tl.arange(0, BLOCK_N) < ctx_len
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale,
                                     UPCAST_DOT, DOT_PRECISION)

    # 2. The chunk itself, read contiguously from k/v: query i sees chunk keys j <= i. Key tiles
    #    wholly left of this query tile's first token are visible to every row (no mask); the
    #    tiles from there to the tile's last token apply the causal mask. The first of them starts
    #    at or before q_lo, so every row (padding rows too) has a visible key in its first tile.
    interior = (q_lo // BLOCK_N) * BLOCK_N
    for n0 in range(0, interior, BLOCK_N):
        kv_rows = (q_start + n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        k = tl.load(k_ptr + kv_rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptr + kv_rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=d_mask[None, :], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, m_mask[:, None], m_i, l_i, acc, qk_scale,
                                     UPCAST_DOT, DOT_PRECISION, MASKED=False)
    hi = tl.minimum(q_lo + BLOCK_T, q_len)
    for n0 in range(interior, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < hi
        kv_rows = (q_start + n).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + kv_rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=kv_mask, other=0.0)
        valid = n_mask[None, :] & (n[None, :] <= m[:, None])
        m_i, l_i, acc = _attend_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, UPCAST_DOT, DOT_PRECISION)

    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


# ---- launchers --------------------------------------------------------------------------------


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(f"key/value caches must be [num_blocks, block_size, kv_heads, head_dim] and alike, "
                         f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the caches' head_dim must be contiguous")
    if key_cache.dtype not in _DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"cache dtype must be one of {_DTYPES}, got {key_cache.dtype}/{value_cache.dtype}")


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's K/V [T, kv_heads, head_dim] at its flat cache slot
    (``block * block_size + offset``); a negative slot is skipped."""
    _check_cache(key_cache, value_cache)
    t = key.shape[0]
    if t == 0:
        return
    _, page_size, kvh, d = key_cache.shape
    if key.shape != (t, kvh, d) or value.shape != (t, kvh, d) or slot_mapping.shape != (t,):
        raise ValueError(f"key/value must be [T, {kvh}, {d}] with slot_mapping [T], got "
                         f"{tuple(key.shape)}, {tuple(value.shape)}, {tuple(slot_mapping.shape)}")
    if key.dtype != key_cache.dtype or value.dtype != value_cache.dtype:
        raise ValueError(f"key/value dtype {key.dtype} must match the cache's {key_cache.dtype}")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value head_dim must be contiguous")
    _reshape_and_cache_kernel[(t,)](
        key, value, key_cache, value_cache, slot_mapping.to(key.device),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        NUM_KV_HEADS=kvh, HEAD_DIM=d, PAGE_SIZE=page_size, KVH_PAD=_pow2(kvh), D_PAD=_pow2(d),
        num_warps=4 if kvh * d >= 1024 else 2,
    )


def decode_num_splits(batch: int, num_kv_heads: int, head_blocks: int, max_seq_len: int, num_sms: int) -> int:
    """How many context splits per (sequence, kv head) for the decode kernel (a power of two).

    Split until there are about DECODE_PROGRAMS_PER_SM programs per SM to keep the memory system
    busy, but never into slices shorter than DECODE_MIN_SPLIT_TOKENS (each split costs a partial
    write and a share of stage 2). Decided on the host from the batch shape, with no device sync.
    """
    programs = max(1, batch * num_kv_heads * head_blocks)
    want = -(-DECODE_PROGRAMS_PER_SM * num_sms // programs)
    by_len = -(-max(1, max_seq_len) // DECODE_MIN_SPLIT_TOKENS)
    n = max(1, min(want, by_len, DECODE_MAX_SPLITS))
    return 1 << (n - 1).bit_length()  # round up: few distinct values, few compiled variants


def prefill_gqa_pack(group: int, block_m: int = PREFILL_MAX_BLOCK_M) -> int:
    """q heads per prefill program: the largest divisor of the GQA group that fits ``block_m`` rows
    (the whole group for Llama's 4, SmolLM2's 3 or MQA up to 128 heads), so each K/V tile a program
    loads serves that many heads."""
    return max(p for p in range(1, min(group, block_m) + 1) if group % p == 0)


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
                           max_seq_len: int | None = None, num_splits: int | None = None,
                           num_sms: int | None = None, out: torch.Tensor | None = None,
                           workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                           block_n: int = DECODE_BLOCK_N, num_warps: int = DECODE_NUM_WARPS,
                           num_stages: int = DECODE_NUM_STAGES) -> torch.Tensor:
    """Decode attention, one query token per sequence, K/V read through the block tables.

    q [B, H, D] (head_dim contiguous); caches [num_blocks, block_size, kv_heads, D]; block_tables
    [B, max_blocks] int32; seq_lens [B] int32, each the context length including the current
    token (already in the cache). Returns [B, H, D] in q's dtype (``out`` if given); a sequence of
    length 0 gets zeros. ``num_splits`` overrides the split-K heuristic (``decode_num_splits``,
    which needs ``max_seq_len``: pass it to avoid a device sync). ``workspace`` = (partial outputs
    [B, H, splits, D] fp32, log-sum-exps [B, H, splits] fp32) when splitting, else allocated.
    """
    _check_cache(key_cache, value_cache)
    b, h, d = q.shape
    _, page_size, kvh, dc = key_cache.shape
    if dc != d or h % kvh or q.dtype != key_cache.dtype or q.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit caches {tuple(key_cache.shape)} "
                         f"{key_cache.dtype} (heads a multiple of kv heads, same head_dim and dtype)")
    if out is None:
        out = torch.empty_like(q)
    if b == 0:
        return out
    group = h // kvh
    block_h = min(64, _pow2(group, 16))  # tl.dot needs M >= 16; a larger group takes several programs
    head_blocks = -(-group // block_h)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
        num_splits = decode_num_splits(b, kvh, head_blocks, max_seq_len, num_sms)
    d_pad = _pow2(d, 16)
    upcast, precision = _dot_options(q.dtype)
    if num_splits > 1:
        if workspace is None:
            workspace = (torch.empty(b, h, num_splits, d, dtype=torch.float32, device=q.device),
                         torch.empty(b, h, num_splits, dtype=torch.float32, device=q.device))
        mid_o, mid_lse = workspace
        if mid_o.shape != (b, h, num_splits, d) or mid_lse.shape != (b, h, num_splits) or mid_o.stride(-1) != 1 \
                or mid_lse.stride(-1) != 1:
            raise ValueError("workspace must be ([B, H, splits, D], [B, H, splits]) float32")
    else:
        mid_o = mid_lse = out  # unused by the kernel
    block_tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    ms = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1)) \
        if num_splits > 1 else (0, 0, 0, 0, 0)
    _decode_stage1_kernel[(b, kvh * head_blocks, num_splits)](
        q, key_cache, value_cache, block_tables, seq_lens, out, mid_o, mid_lse, scale * 1.4426950408889634,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), *ms,
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=d, D_PAD=d_pad, BLOCK_H=block_h, BLOCK_N=block_n,
        PAGE_SIZE=page_size, NUM_SPLITS=num_splits, UPCAST_DOT=upcast, DOT_PRECISION=precision,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_stage2_kernel[(b, h)](
            mid_o, mid_lse, seq_lens, out, *ms, out.stride(0), out.stride(1),
            HEAD_DIM=d, D_PAD=d_pad, NUM_SPLITS=num_splits, SPLITS_PAD=_pow2(num_splits), BLOCK_N=block_n,
            num_warps=2 if d_pad <= 128 else 4,
        )
    return out


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, block_tables: torch.Tensor, cu_query_lens: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, *, max_query_len: int | None = None,
                      out: torch.Tensor | None = None, block_m: int | None = None,
                      block_n: int = PREFILL_BLOCK_N, num_warps: int | None = None,
                      num_stages: int | None = None, gqa_pack: int | None = None,
                      num_sms: int | None = None) -> torch.Tensor:
    """Causal attention for prefill chunks back to back: q [Tp, H, D], k/v [Tp, kv_heads, D].

    Sequence i's chunk is rows ``cu_query_lens[i]:cu_query_lens[i+1]`` (int32 [Bp+1]); its
    ``seq_lens[i] - query_len`` earlier tokens are read from the paged cache through
    ``block_tables[i]``, the chunk's own K/V from ``k``/``v`` (bottom-right-aligned causal mask).
    Returns [Tp, H, D] in q's dtype (``out`` if given).

    ``block_m`` counts query rows per program: ``gqa_pack`` q heads of one kv head (a divisor of
    the group; default ``prefill_gqa_pack``) times ``block_m // gqa_pack`` tokens. ``gqa_pack=1``
    is one program per q head. ``num_sms`` (the GPU's, read from the device if not given) only
    feeds the default ``block_m``.
    """
    _check_cache(key_cache, value_cache)
    tp, h, d = q.shape
    _, page_size, kvh, dc = key_cache.shape
    if dc != d or h % kvh or k.shape != (tp, kvh, d) or v.shape != (tp, kvh, d):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches "
                         f"{tuple(key_cache.shape)}")
    if not (q.dtype == k.dtype == v.dtype == key_cache.dtype):
        raise ValueError(f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} must match the cache's {key_cache.dtype}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q/k/v head_dim must be contiguous")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = cu_query_lens.shape[0] - 1
    if tp == 0 or num_seqs == 0:
        return out
    if not max_query_len:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max())
    d_pad = _pow2(d, 16)
    group = h // kvh
    if gqa_pack is None:
        gqa_pack = prefill_gqa_pack(group, block_m or PREFILL_MAX_BLOCK_M)
    if group % gqa_pack:
        raise ValueError(f"gqa_pack={gqa_pack} must divide the GQA group ({group})")
    if block_m is None:
        block_m = min(PREFILL_MAX_BLOCK_M, _pow2(max_query_len * gqa_pack, 16))
        if block_m == 128 and gqa_pack <= 64:
            if num_sms is None:
                num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
            programs = triton.cdiv(max_query_len, 128 // gqa_pack) * num_seqs * (h // gqa_pack)
            if programs < PREFILL_MIN_PROGRAMS_PER_SM * num_sms:
                block_m = 64  # under ~4 programs per SM, 2 resident 64-row programs per SM win
    if gqa_pack > block_m:
        raise ValueError(f"gqa_pack={gqa_pack} q heads do not fit a {block_m}-row query tile")
    block_t = block_m // gqa_pack  # query tokens per program
    upcast, precision = _dot_options(q.dtype)
    block_tables = block_tables if block_tables.dtype == torch.int32 else block_tables.to(torch.int32)
    cu_query_lens = cu_query_lens if cu_query_lens.dtype == torch.int32 else cu_query_lens.to(torch.int32)
    seq_lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.to(torch.int32)
    grid = (triton.cdiv(max_query_len, block_t), num_seqs, h // gqa_pack)
    _prefill_kernel[grid](
        q, k, v, key_cache, value_cache, block_tables, cu_query_lens, seq_lens, out, scale * 1.4426950408889634,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, PACK=gqa_pack, HEAD_DIM=d, D_PAD=d_pad, BLOCK_M=block_m, BLOCK_T=block_t, BLOCK_N=block_n,
        PAGE_SIZE=page_size, UPCAST_DOT=upcast, DOT_PRECISION=precision,
        num_warps=num_warps or (8 if block_m * d_pad >= 128 * 128 else 4),
        num_stages=num_stages or (3 if d_pad <= 128 else 2),
    )
    return out


# ---- backend ----------------------------------------------------------------------------------


class TritonAttention(TorchAttention):
    """Attention backend on the Triton kernels: cache write, split-K decode, ragged prefill.

    ``prepare`` moves the step's metadata to the device once (the runner builds it on the host)
    and replaces ``meta.slot_mapping`` with the device copy, so every layer's ``write_kv`` and
    attention call reads device tensors without a copy or sync of its own.
    """

    name = "triton"

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device if device is not None else "cuda")
        if self.device.type != "cuda" and not interpreting():
            raise RuntimeError(f"the Triton attention backend needs a CUDA device (got {self.device}); "
                               "set TRITON_INTERPRET=1 before importing triton to run it on CPU (slow, for tests)")
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 8)

    def prefill_rows_independent(self, dtype: torch.dtype) -> bool:
        # Each query row's program walks the same key blocks in the same order, whatever the chunk's
        # other rows.
        return True

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        dev = self.device

        def to_dev(x: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return x.to(device=dev, dtype=dtype, non_blocking=True)

        meta.slot_mapping = to_dev(meta.slot_mapping, torch.int64)
        cache: dict = {"workspaces": {}}
        if meta.num_decode_tokens:
            cache["decode_block_tables"] = to_dev(meta.decode_block_tables)
            cache["decode_seq_lens"] = to_dev(meta.decode_seq_lens)
        if meta.num_prefills:
            cu = torch.zeros(meta.num_prefills + 1, dtype=torch.int32)
            torch.cumsum(meta.prefill_query_lens.cpu(), 0, out=cu[1:])
            cache["prefill_cu_query_lens"] = to_dev(cu)
            cache["prefill_seq_lens"] = to_dev(meta.prefill_seq_lens)
            cache["prefill_block_tables"] = to_dev(meta.prefill_block_tables)
        meta.cache = cache

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """reshape_and_cache: store each new token's K/V [T, kv_heads, head_dim] at its slot."""
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D]; one query per sequence."""
        c = meta.cache
        bd, h, d = q.shape
        kvh = key_cache.shape[2]
        group = h // kvh
        head_blocks = -(-group // min(64, _pow2(group, 16)))
        num_splits = decode_num_splits(bd, kvh, head_blocks, meta.max_decode_seq_len, self.num_sms)
        workspace = None
        if num_splits > 1:  # one workspace per step, shared by every layer
            key = (h, d, num_splits)
            workspace = c["workspaces"].get(key)
            if workspace is None:
                workspace = (torch.empty(bd, h, num_splits, d, dtype=torch.float32, device=q.device),
                             torch.empty(bd, h, num_splits, dtype=torch.float32, device=q.device))
                c["workspaces"][key] = workspace
        return paged_decode_attention(q, key_cache, value_cache, c["decode_block_tables"], c["decode_seq_lens"],
                                      scale, num_splits=num_splits, out=out, workspace=workspace)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q [Tp, H, D], k/v [Tp, kv_heads, D]: the prefill chunks back to back -> [Tp, H, D]."""
        c = meta.cache
        return prefill_attention(q, k, v, key_cache, value_cache, c["prefill_block_tables"],
                                 c["prefill_cu_query_lens"], c["prefill_seq_lens"], scale,
                                 max_query_len=meta.max_prefill_query_len, out=out, num_sms=self.num_sms)
