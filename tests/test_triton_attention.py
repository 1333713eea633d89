"""The Triton kernels (cache write, split-K paged decode, ragged chunked prefill) against float64
references, in Triton's CPU interpreter unless ``TRITON_INTERPRET=0`` is set on a CUDA machine.

Everything a kernel must not read or leave unwritten is NaN: unused cache blocks, slots past a
sequence's end, padded block-table entries (they point at a poisoned block), the outputs and the
split-K workspace before each call. The interpreter is slow, so shapes are small and the grid is
a hand-picked cover of (dtype, MHA/GQA/MQA, head size, block size) rather than a full product.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run on CPU tensors

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402,F401  (no skip: a missing triton must fail this module)

from pagoda_kernels.attention import AttentionMetadata, TorchAttention, write_kv  # noqa: E402
from pagoda_kernels.triton_attention import (  # noqa: E402
    TritonAttention, decode_num_splits, interpreting, paged_decode_attention, prefill_attention,
    prefill_gqa_pack, reshape_and_cache)

DEVICE = torch.device("cpu" if interpreting() else "cuda")
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=1e-2, atol=1e-2)}
FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16
NAN = float("nan")


# ---- inputs and references ---------------------------------------------------------------------


def make_paged(seq_lens: list[int], kvh: int, d: int, bs: int, dtype: torch.dtype, g: torch.Generator,
               extra_blocks: int = 3, table_pad: int = 2):
    """Random K/V for each sequence's first ``seq_lens[i]`` positions in scattered physical blocks;
    every other slot is NaN, and padded block-table entries point at a NaN block."""
    nblk = [-(-n // bs) for n in seq_lens]
    used = sum(nblk)
    num_blocks = used + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    key_cache = torch.full((num_blocks, bs, kvh, d), NAN, dtype=dtype)
    value_cache = torch.full((num_blocks, bs, kvh, d), NAN, dtype=dtype)
    block_tables = torch.full((len(seq_lens), max(nblk + [1]) + table_pad), int(perm[used]), dtype=torch.int32)
    at = 0
    for i, (n, k) in enumerate(zip(seq_lens, nblk)):
        ids = perm[at:at + k]
        at += k
        block_tables[i, :k] = ids.int()
        pos = torch.arange(n)
        key_cache[ids[pos // bs], pos % bs] = torch.randn(n, kvh, d, generator=g).to(dtype)
        value_cache[ids[pos // bs], pos % bs] = torch.randn(n, kvh, d, generator=g).to(dtype)
    return key_cache, value_cache, block_tables


def seq_kv(key_cache, value_cache, block_table, n):
    """A sequence's first n K/V rows [n, kvh, d], gathered through its block table, in float64."""
    bs = key_cache.shape[1]
    pos = torch.arange(n)
    blocks = block_table.long()[pos // bs]
    return key_cache[blocks, pos % bs].double(), value_cache[blocks, pos % bs].double()


def ref_attention(q, k, v, q_pos, scale):
    """float64 causal attention: q [n, H, D] at sequence positions q_pos sees keys 0..q_pos."""
    h, kvh = q.shape[1], k.shape[1]
    kk = k.repeat_interleave(h // kvh, dim=1)  # [L, H, D]
    vv = v.repeat_interleave(h // kvh, dim=1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), kk) * scale
    s = s.masked_fill(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), vv)


def ref_decode(q, key_cache, value_cache, block_tables, seq_lens, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, n in enumerate(seq_lens.tolist()):
        if n:
            k, v = seq_kv(key_cache, value_cache, block_tables[i], n)
            out[i] = ref_attention(q[i:i + 1], k, v, torch.tensor([n - 1]), scale)[0]
    return out


def dev(*xs):
    return [x.to(DEVICE) for x in xs]


def assert_close(out, ref, dtype):
    out = out.cpu()
    assert not out.isnan().any(), "output has NaN: unwritten elements or a read outside a sequence"
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


# ---- reshape_and_cache -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,kvh,d,bs", [(FP32, 2, 64, 16), (BF16, 8, 80, 32), (FP16, 1, 128, 16),
                                            (BF16, 3, 96, 16)])
def test_reshape_and_cache(dtype, kvh, d, bs):
    g = torch.Generator().manual_seed(kvh * 100 + d)
    t, h, num_blocks = 11, 2 * kvh, 6
    # k/v as the model produces them: views into a fused qkv projection output (token stride > kvh * d).
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    slots = torch.randperm(num_blocks * bs, generator=g)[:t]
    slots[4] = -1  # a padding token: skipped
    key_cache = torch.full((num_blocks, bs, kvh, d), NAN, dtype=dtype)
    value_cache = torch.full((num_blocks, bs, kvh, d), NAN, dtype=dtype)
    k_d, v_d, kc_d, vc_d, slots_d = dev(k, v, key_cache, value_cache, slots)
    reshape_and_cache(k_d, v_d, kc_d, vc_d, slots_d)
    kc, vc = kc_d.cpu().view(-1, kvh, d), vc_d.cpu().view(-1, kvh, d)
    keep = slots >= 0
    assert torch.equal(kc[slots[keep]], k[keep]) and torch.equal(vc[slots[keep]], v[keep])
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
    untouched[slots[keep]] = False
    assert kc[untouched].isnan().all() and vc[untouched].isnan().all()


# ---- decode ------------------------------------------------------------------------------------

LENS = [1, 15, 16, 17, 33, 100]  # below, at and past block boundaries


@pytest.mark.parametrize("dtype,h,kvh,d,bs", [
    (FP32, 4, 4, 64, 16),  # MHA
    (BF16, 8, 2, 128, 16),  # GQA, group 4
    (FP16, 8, 1, 80, 32),  # MQA
    (BF16, 9, 3, 96, 32),  # group 3 (padded to 16 rows)
    (FP32, 12, 2, 96, 16),
    (FP16, 32, 8, 128, 32),  # Llama-8B's heads
    (FP32, 6, 2, 80, 32),
])
def test_decode_matches_reference(dtype, h, kvh, d, bs):
    g = torch.Generator().manual_seed(h * 1000 + d + bs)
    kc, vc, bt = make_paged(LENS, kvh, d, bs, dtype, g)
    sl = torch.tensor(LENS, dtype=torch.int32)
    q = (2 * torch.randn(len(LENS), h, d, generator=g)).to(dtype)
    scale = 1 / math.sqrt(d)
    ref = ref_decode(q, kc, vc, bt, sl, scale)
    q_d, kc_d, vc_d, bt_d, sl_d = dev(q, kc, vc, bt, sl)
    # One pass per sequence in 64-token tiles, then split-K over 16-token tiles (empty splits included).
    for num_splits, block_n in ((1, 64), (4, 16)):
        out = torch.full_like(q_d, NAN)
        ws = (torch.full((len(LENS), h, num_splits, d), NAN, device=DEVICE),
              torch.full((len(LENS), h, num_splits), NAN, device=DEVICE))
        res = paged_decode_attention(q_d, kc_d, vc_d, bt_d, sl_d, scale, num_splits=num_splits, out=out,
                                     workspace=ws if num_splits > 1 else None, block_n=block_n)
        assert res is out
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_decode_split_k_long_context(dtype):
    """One long context among short ones: split counts that do not divide the length, splits that
    are empty for the short sequences, and the heuristic's own choice."""
    g = torch.Generator().manual_seed(7)
    lens = [700, 3, 1, 130]
    h, kvh, d, bs = 8, 2, 64, 16
    kc, vc, bt = make_paged(lens, kvh, d, bs, dtype, g)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    ref = ref_decode(q, kc, vc, bt, sl, 0.125)
    q_d, kc_d, vc_d, bt_d, sl_d = dev(q, kc, vc, bt, sl)
    for num_splits, block_n in ((3, 32), (16, 16)):
        out = paged_decode_attention(q_d, kc_d, vc_d, bt_d, sl_d, 0.125, num_splits=num_splits, block_n=block_n)
        assert_close(out, ref, dtype)
    out = paged_decode_attention(q_d, kc_d, vc_d, bt_d, sl_d, 0.125, max_seq_len=700, num_sms=4)
    assert_close(out, ref, dtype)


def test_decode_num_splits_heuristic():
    # Llama-8B on an H100 (132 SMs): a big batch fills the GPU alone, a single long sequence splits
    # (the choices the H100 sweep found fastest: bench/triton_sweep.py, kernels/README.md).
    assert decode_num_splits(256, 8, 1, 2048, 132) == 1
    assert decode_num_splits(64, 8, 1, 2048, 132) == 1
    assert decode_num_splits(8, 8, 1, 8192, 132) == 8
    assert decode_num_splits(1, 8, 1, 32768, 132) == 64
    assert decode_num_splits(1, 8, 1, 300, 132) == 2  # never slices under 256 tokens
    assert decode_num_splits(4, 8, 1, 100, 132) == 1
    assert decode_num_splits(0, 8, 1, 0, 132) == 1


def test_decode_peaked_softmax():
    """Large logits: the running max moves across tiles and splits."""
    g = torch.Generator().manual_seed(3)
    lens = [300, 45, 1]
    kc, vc, bt = make_paged(lens, 2, 64, 16, FP32, g)
    sl = torch.tensor(lens, dtype=torch.int32)
    q = 30 * torch.randn(3, 4, 64, generator=g)
    ref = ref_decode(q, kc, vc, bt, sl, 0.125)
    for num_splits in (1, 4):
        assert_close(paged_decode_attention(*dev(q, kc, vc, bt, sl), 0.125, num_splits=num_splits, block_n=32),
                     ref, FP32)


def test_decode_strided_inputs():
    """Per-layer cache views of one [layers, 2, ...] tensor, q a view of a fused projection, and a
    block table that is a column slice of a wider one (the runner's shapes)."""
    g = torch.Generator().manual_seed(9)
    lens, h, kvh, d, bs, dtype = [50, 3, 130], 6, 2, 64, 16, BF16
    kc, vc, bt = make_paged(lens, kvh, d, bs, dtype, g)
    kv = torch.full((2, 2, *kc.shape), NAN, dtype=dtype)
    kv[1, 0], kv[1, 1] = kc, vc
    wide = torch.full((len(lens), bt.shape[1] + 5), -1, dtype=torch.int32)
    wide[:, :bt.shape[1]] = bt
    qkv = torch.randn(len(lens), (h + 2 * kvh) * d, generator=g).to(dtype)
    q = qkv[:, :h * d].view(len(lens), h, d)
    sl = torch.tensor(lens, dtype=torch.int32)
    ref = ref_decode(q, kc, vc, bt, sl, 0.125)
    kv_d, wide_d, q_d, sl_d = dev(kv, wide, q, sl)
    for num_splits in (1, 2):
        out = paged_decode_attention(q_d, kv_d[1, 0], kv_d[1, 1], wide_d[:, :bt.shape[1]], sl_d, 0.125,
                                     num_splits=num_splits)
        assert_close(out, ref, dtype)


def test_decode_empty_sequence_and_empty_batch():
    g = torch.Generator().manual_seed(1)
    kc, vc, bt = make_paged([0, 5], 2, 64, 16, FP32, g)
    q = torch.randn(2, 4, 64, generator=g)
    sl = torch.tensor([0, 5], dtype=torch.int32)
    ref = ref_decode(q, kc, vc, bt, sl, 0.125)
    for num_splits in (1, 2):
        out = paged_decode_attention(*dev(q, kc, vc, bt, sl), 0.125, num_splits=num_splits)
        assert_close(out, ref, FP32)
        assert (out[0] == 0).all()
    q_d, kc_d, vc_d, bt_d, sl_d = dev(q, kc, vc, bt, sl)
    assert paged_decode_attention(q_d[:0], kc_d, vc_d, bt_d[:0], sl_d[:0], 0.125).shape == (0, 4, 64)


# ---- prefill -----------------------------------------------------------------------------------

# (context already cached, query chunk length): a first chunk, later chunks whose context ends
# mid-block or on a boundary, a one-token chunk, and chunks longer than one query tile.
CHUNKS = [(0, 37), (20, 13), (45, 1), (16, 16), (5, 50), (0, 1)]


def make_prefill(chunks, h, kvh, d, bs, dtype, g):
    """Caches holding each sequence's context and chunk (the chunk written as each layer does
    before attending), plus q/k/v of the chunks back to back as views of a fused qkv output."""
    seq_lens = [c + n for c, n in chunks]
    kc, vc, bt = make_paged(seq_lens, kvh, d, bs, dtype, g)
    t = sum(n for _, n in chunks)
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype)
    q = qkv[:, :h * d].view(t, h, d)
    k = qkv[:, h * d:(h + kvh) * d].view(t, kvh, d)
    v = qkv[:, (h + kvh) * d:].view(t, kvh, d)
    slots = []
    for i, (c, n) in enumerate(chunks):
        pos = torch.arange(c, c + n)
        slots.append(bt[i].long()[pos // bs] * bs + pos % bs)
    write_kv(k, v, kc, vc, torch.cat(slots))
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([n for _, n in chunks]).cumsum(0)
    return q, k, v, kc, vc, bt, cu, torch.tensor(seq_lens, dtype=torch.int32)


def ref_prefill(q, kc, vc, bt, chunks, scale):
    out, row = [], 0
    for i, (c, n) in enumerate(chunks):
        k, v = seq_kv(kc, vc, bt[i], c + n)
        out.append(ref_attention(q[row:row + n], k, v, torch.arange(c, c + n), scale))
        row += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype,h,kvh,d,bs", [
    (FP32, 4, 4, 64, 16),  # MHA: nothing to pack
    (BF16, 8, 2, 128, 32),  # group 4
    (FP16, 4, 1, 80, 16),  # MQA, group 4
    (BF16, 6, 2, 96, 16),  # group 3: 16-row tiles hold 5 tokens and a padding row
    (FP32, 6, 3, 96, 32),  # group 2
    (FP32, 14, 2, 64, 16),  # group 7: 16-row tiles hold 2 tokens and 2 padding rows
    (FP16, 24, 1, 64, 16),  # MQA, group 24: 16-row tiles hold 12 heads x 1 token, two programs per kv head
])
def test_prefill_matches_reference(dtype, h, kvh, d, bs):
    g = torch.Generator().manual_seed(h * 1000 + d + bs)
    q, k, v, kc, vc, bt, cu, sl = make_prefill(CHUNKS, h, kvh, d, bs, dtype, g)
    scale = 1 / math.sqrt(d)
    ref = ref_prefill(q, kc, vc, bt, CHUNKS, scale)
    args = dev(q, k, v, kc, vc, bt, cu, sl)
    # (block_m, block_n, gqa_pack): small packed tiles (few tokens per tile, key tiles wider than a
    # query tile's tokens, partial diagonal tiles), the launch defaults, and one program per q head
    # (slow in the interpreter for the large groups).
    configs = [(16, 16, None), (None, 64, None)] + ([(32, 16, 1)] if h // kvh <= 4 else [])
    for block_m, block_n, pack in configs:
        out = torch.full_like(args[0], NAN)
        res = prefill_attention(*args, scale, max_query_len=50, out=out, block_m=block_m, block_n=block_n,
                                gqa_pack=pack)
        assert res is out
        assert_close(out, ref, dtype)


def test_prefill_gqa_pack_choice():
    assert prefill_gqa_pack(1) == 1
    assert prefill_gqa_pack(4) == 4  # Llama-8B: the whole group in one program
    assert prefill_gqa_pack(3) == 3 and prefill_gqa_pack(7) == 7
    assert prefill_gqa_pack(32, 16) == 16  # more heads than rows: the group takes two programs
    assert prefill_gqa_pack(24, 16) == 12
    g = torch.Generator().manual_seed(2)
    args = dev(*make_prefill([(3, 5)], 32, 1, 64, 16, FP32, g))
    with pytest.raises(ValueError, match="divide"):
        prefill_attention(*args, 0.125, gqa_pack=3)
    with pytest.raises(ValueError, match="fit"):
        prefill_attention(*args, 0.125, block_m=16, gqa_pack=32)
    # MQA with 128 q heads: one token per 128-row tile, so the few-programs rule keeps 128 rows.
    chunks = [(3, 2)]
    q, k, v, kc, vc, bt, cu, sl = make_prefill(chunks, 128, 1, 16, 16, FP32, g)
    out = prefill_attention(*dev(q, k, v, kc, vc, bt, cu, sl), 0.25, num_sms=132)
    assert_close(out, ref_prefill(q, kc, vc, bt, chunks, 0.25), FP32)


def test_prefill_single_long_chunk_peaked():
    """A 150-token chunk over 70 cached tokens with large logits: 32-row query tiles packed (16
    tokens x 2 heads) and per head (32 tokens), and 128-row packed tiles (64 tokens)."""
    g = torch.Generator().manual_seed(4)
    chunks = [(70, 150)]
    q, k, v, kc, vc, bt, cu, sl = make_prefill(chunks, 4, 2, 64, 16, FP32, g)
    q = q * 10  # logits with a standard deviation of 10: the running max moves tile to tile
    ref = ref_prefill(q, kc, vc, bt, chunks, 0.125)
    for block_m, pack in ((32, None), (32, 1), (128, None)):
        out = prefill_attention(*dev(q, k, v, kc, vc, bt, cu, sl), 0.125, block_m=block_m, block_n=32,
                                gqa_pack=pack)
        assert_close(out, ref, FP32)


# ---- the backend -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_backend_mixed_step_matches_torch_backend(dtype):
    """One step as the runner builds it: decodes then prefill chunks, the new tokens written with
    write_kv, every tensor of the metadata on the host. TritonAttention == TorchAttention, and
    both == the float64 reference."""
    g = torch.Generator().manual_seed(11)
    h, kvh, d, bs = 6, 2, 64, 16
    dec_lens = [1, 17, 40, 300]
    chunks = [(0, 21), (32, 9)]
    seq_lens = dec_lens + [c + n for c, n in chunks]
    kc, vc, bt = make_paged(seq_lens, kvh, d, bs, dtype, g)
    nd = len(dec_lens)
    positions = torch.cat([torch.tensor(dec_lens) - 1] + [torch.arange(c, c + n) for c, n in chunks])
    seq_idx = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor([1] * nd + [n for _, n in chunks]))
    slot_mapping = bt[seq_idx, positions // bs].long() * bs + positions % bs
    kc[slot_mapping // bs, slot_mapping % bs] = NAN  # this step's tokens: not yet in the cache
    vc[slot_mapping // bs, slot_mapping % bs] = NAN
    t = len(positions)
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(t, kvh, d, generator=g).to(dtype)
    v = torch.randn(t, kvh, d, generator=g).to(dtype)
    dec_blocks = -(-max(dec_lens) // bs)
    pre_blocks = -(-max(seq_lens[nd:]) // bs)

    def meta():
        return AttentionMetadata(
            slot_mapping=slot_mapping.clone(), num_decode_tokens=nd,
            decode_block_tables=bt[:nd, :dec_blocks].contiguous(),
            decode_seq_lens=torch.tensor(dec_lens, dtype=torch.int32), num_prefills=len(chunks),
            prefill_query_lens=torch.tensor([n for _, n in chunks]),
            prefill_seq_lens=torch.tensor(seq_lens[nd:]), prefill_block_tables=bt[nd:, :pre_blocks].contiguous(),
            max_prefill_query_len=max(n for _, n in chunks), max_prefill_seq_len=max(seq_lens[nd:]),
            max_decode_seq_len=max(dec_lens))

    def step(backend, m, q, k, v, kc, vc):
        backend.prepare(m, bs)
        if isinstance(backend, TritonAttention):
            backend.write_kv(k, v, kc, vc, m.slot_mapping)
        else:
            write_kv(k, v, kc, vc, m.slot_mapping)
        return torch.cat([backend.decode(q[:nd], kc, vc, m, 0.125),
                          backend.prefill(q[nd:], k[nd:], v[nd:], kc, vc, m, 0.125)])

    # TorchAttention multiplies masked-out probabilities (0) by whatever the unused slots of a
    # sequence's last block hold, so it gets a cache with zeros where Triton's has NaN.
    kc_ref, vc_ref = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    expected = step(TorchAttention(), meta(), q, k, v, kc_ref, vc_ref)
    kc_d, vc_d, q_d, k_d, v_d = dev(kc, vc, q, k, v)
    triton_backend = TritonAttention(DEVICE)
    assert triton_backend.name == "triton"
    m = meta()
    got = step(triton_backend, m, q_d, k_d, v_d, kc_d, vc_d)
    assert m.slot_mapping.device.type == DEVICE.type
    written = torch.zeros(kc.shape[:2], dtype=torch.bool)
    written.view(-1)[slot_mapping] = True
    assert torch.equal(kc_d.cpu()[written], kc_ref[written]) and torch.equal(vc_d.cpu()[written], vc_ref[written])
    assert torch.equal(kc_d.cpu()[~written].nan_to_num(0.0), kc_ref[~written])  # nothing else touched
    ref = torch.cat([ref_decode(q[:nd], kc_ref, vc_ref, bt[:nd], torch.tensor(dec_lens), 0.125),
                     ref_prefill(q[nd:], kc_ref, vc_ref, bt[nd:], chunks, 0.125)])
    assert_close(got, ref, dtype)
    torch.testing.assert_close(got.cpu().float(), expected.float(), **TOL[dtype])


def test_engine_greedy_matches_torch_backend(tiny_llama_dir):
    """The engine with attention_backend="triton" (cache write, decode and chunked prefill on the
    Triton kernels) gives the torch backend's greedy tokens."""
    from engine_service import LLM, SamplingParams

    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(n)] for i, n in enumerate((5, 29, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    # A 24-token budget chunks the 29- and 40-token prompts: later chunks read cached context.
    opts = dict(dtype="float32", max_num_batched_tokens=24, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    llm = LLM(tiny_llama_dir, attention_backend="triton", device=DEVICE.type, **opts)
    assert llm.llm_engine.runner.attn.name == "triton"
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    ref_llm = LLM(tiny_llama_dir, attention_backend="torch", device="cpu", **opts)
    want = [o.outputs[0].token_ids for o in ref_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == want
