"""The C++ CPU paged attention kernels (decode, prefill / chunked prefill) against float64 references
and against TorchAttention."""
from __future__ import annotations

import math

import pytest
import torch

from pagoda_kernels.attention import (INT8_ROW_SCALE_BYTES, AttentionMetadata, TorchAttention,
                                     dequantize_int8_rows, quantize_int8_rows, write_kv)
from pagoda_kernels.cpu_attention import (CpuAttention, build_cpu_flags, decode_f8_flushes_subnormals,
                                          decode_supports_f8, decode_supports_int8, load_extension,
                                          paged_decode_attention, paged_prefill_attention, prefill_supported)

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


@pytest.fixture(scope="module")
def op():
    return load_extension()


def reference(q, key_cache, value_cache, block_tables, seq_lens, scale):
    """Per sequence: gather its K/V rows through the block table, softmax(q k^T * scale) v in float64."""
    b, h, d = q.shape
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(seq_lens[i])
        if n == 0:
            out[i] = 0
            continue
        pos = torch.arange(n)
        blocks = block_tables[i].long()[pos // bs]
        k = key_cache[blocks, pos % bs].double().permute(1, 2, 0)  # [kvh, d, n]
        v = value_cache[blocks, pos % bs].double().transpose(0, 1)  # [kvh, n, d]
        s = torch.matmul(q[i].double().view(kvh, h // kvh, d), k) * scale  # [kvh, g, n]
        out[i] = torch.matmul(s.softmax(-1), v).reshape(h, d)
    return out


def make_inputs(seq_lens, h, kvh, d, bs, dtype, extra_blocks=7, poison=True, seed=0, q_scale=2.0,
                table_pad=3):
    """Random caches with each sequence's blocks scattered (shuffled physical ids). Everything the
    kernel must not read — unused blocks, slots past a sequence's end, padded table entries — is
    NaN when ``poison`` (else random), so a read outside a sequence shows up in the output."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = torch.tensor(seq_lens, dtype=torch.int32)
    nblk = [(int(n) + bs - 1) // bs for n in seq_lens]
    used = sum(nblk)
    num_blocks = used + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(nblk + [1]) + table_pad
    fill = float("nan") if poison else 0.0
    key_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    unused = perm[used:]
    block_tables = torch.empty(len(seq_lens), max_blocks, dtype=torch.int32)
    block_tables[:] = unused[0] if poison else perm[0]  # padding entries point at a poisoned block
    at = 0
    for i, n in enumerate(nblk):
        ids = perm[at:at + n]
        at += n
        block_tables[i, :n] = ids.int()
        tail = int(seq_lens[i]) - (n - 1) * bs if n else 0
        if poison and n and tail < bs:  # slots past the end of the last block
            key_cache[ids[-1], tail:] = fill
            value_cache[ids[-1], tail:] = fill
    if poison:
        key_cache[unused] = fill
        value_cache[unused] = fill
    q = (torch.randn(len(seq_lens), h, d, generator=g) * q_scale).to(dtype)
    return q, key_cache, value_cache, block_tables, seq_lens


def check(q, key_cache, value_cache, block_tables, seq_lens, scale, op=None, num_threads=None):
    out = torch.full_like(q, float("nan"))
    if op is None:
        res = paged_decode_attention(q, key_cache, value_cache, block_tables, seq_lens, scale, out=out)
        assert res is out
    else:
        op(q, key_cache, value_cache, block_tables, seq_lens, scale, out, num_threads)
    ref = reference(q, key_cache, value_cache, block_tables, seq_lens, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TOL[q.dtype])
    return out


LENS = [1, 15, 16, 17, 31, 33, 100, 257, 5, 64]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("h,kvh", [(4, 4), (9, 9), (9, 3), (8, 2), (16, 1), (12, 1)])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
def test_matches_reference(dtype, h, kvh, d, bs):
    q, kc, vc, bt, sl = make_inputs(LENS, h, kvh, d, bs, dtype, seed=h * 1000 + d + bs)
    check(q, kc, vc, bt, sl, 1 / math.sqrt(d))


@pytest.mark.parametrize("d", [80, 96])
def test_other_head_sizes(d):
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, bt, sl = make_inputs([1, 7, 40, 77], 6, 2, d, 16, dtype, seed=d)
        check(q, kc, vc, bt, sl, 1 / math.sqrt(d))


@pytest.mark.parametrize("num_threads", [1, 2, 3, 8])
@pytest.mark.parametrize("lens", [[2000], [1500, 9], [700, 1100, 1], [3000, 10, 0, 20, 5, 257],
                                  [40, 3000, 17, 9, 1, 33, 64, 100, 2]])
def test_thread_counts_and_context_split(op, num_threads, lens):
    """Few long sequences, or one long among short ones: long contexts are split into slices across
    threads (flash-decoding) and merged."""
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, bt, sl = make_inputs(lens, 8, 2, 64, 16, dtype, seed=len(lens) + num_threads)
        check(q, kc, vc, bt, sl, 0.125, op=op, num_threads=num_threads)


@pytest.mark.parametrize("num_threads", [2, 3, 8])
def test_a_rows_bits_do_not_depend_on_the_batch(op, num_threads):
    """How a long context is split over threads depends on its own length and the thread count,
    never on the rest of the batch: each row alone gives bitwise what it gives among others (long
    ones split, short ones not, one sequence's consecutive rows grouped)."""
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, bt, sl = make_inputs([3000, 10, 700, 1500, 1501, 300, 2049], 9, 3, 64, 16, dtype, seed=8)
        bt[4] = bt[3]  # row 4: the position after row 3's, same sequence
        sl[4] = sl[3] + 1
        kc[bt[3, 1500 // 16], 1500 % 16] = kc[bt[3, 0], 0]  # a real K/V row for that position
        vc[bt[3, 1500 // 16], 1500 % 16] = vc[bt[3, 0], 0]
        batch = check(q, kc, vc, bt, sl, 0.125, op=op, num_threads=num_threads)
        for i in range(len(sl)):
            alone = torch.empty_like(q[i:i + 1])
            op(q[i:i + 1], kc, vc, bt[i:i + 1], sl[i:i + 1], 0.125, alone, num_threads)
            assert torch.equal(alone[0], batch[i]), f"row {i} ({int(sl[i])} tokens)"


def test_many_sequences(op):
    """A larger batch of random lengths: the dynamic schedule over (sequence, kv head) items."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(1, 200, (70,), generator=g).tolist()
    q, kc, vc, bt, sl = make_inputs(lens, 9, 3, 64, 16, torch.bfloat16, seed=11)
    check(q, kc, vc, bt, sl, 0.125, op=op, num_threads=2)
    check(q, kc, vc, bt, sl, 0.125, op=op, num_threads=1)


def speculative_rows(base_lens, k, bs, dtype, seed):
    """A batch where each sequence of ``base_lens`` is 1 + k rows, as a speculative step verifies
    its draft: its consecutive positions, lengths L .. L + k, the same block-table row."""
    _, kc, vc, bt, _ = make_inputs([n + k for n in base_lens], 9, 3, 64, bs, dtype, seed=seed)
    rows = torch.arange(len(base_lens)).repeat_interleave(k + 1)
    lens = torch.tensor([n + j for n in base_lens for j in range(k + 1)], dtype=torch.int32)
    q = (torch.randn(len(rows), 9, 64, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    return q, kc, vc, bt[rows].contiguous(), lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_a_sequences_consecutive_rows_give_each_rows_own_bits(op, dtype, num_threads):
    """A speculative step's rows (one sequence's consecutive positions, attended as one item that
    reads the K/V once) give bitwise what each row gives in a batch where no rows group (the batch
    reversed: lengths fall), and match the reference."""
    q, kc, vc, bt, sl = speculative_rows([1, 30, 63, 64, 100, 200], 4, 16, dtype, seed=21)
    grouped = check(q, kc, vc, bt, sl, 0.125, op=op, num_threads=num_threads)
    rev = torch.arange(q.shape[0] - 1, -1, -1)
    alone = torch.empty_like(q)
    op(q[rev].contiguous(), kc, vc, bt[rev].contiguous(), sl[rev].contiguous(), 0.125, alone, num_threads)
    assert torch.equal(grouped, alone[rev])


def test_rows_that_only_look_like_one_sequence(op):
    """Rows whose lengths rise by one but that are different sequences (other tables), or share only
    a cached prefix, or differ inside the earlier row's blocks, or are long enough to be split: each
    row still attends its own K/V."""
    q, kc, vc, bt, _ = make_inputs([80, 80, 2502], 9, 3, 64, 16, torch.float32, seed=4)
    s0, s1, s2 = bt[0].clone(), bt[1].clone(), bt[2].clone()
    prefix = torch.cat([s0[:3], s1[3:]])  # sequence 0's first 3 blocks (48 tokens), then 1's
    patched = s0.clone()
    patched[1] = s1[1]  # differs from sequence 0 inside its first 60 tokens
    tables = torch.stack([s0, s1, s0, prefix, s0, patched, s2, s2])
    lens = torch.tensor([70, 71, 40, 41, 60, 61, 2500, 2501], dtype=torch.int32)
    q = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(9)) * 2
    for threads in (1, 2, 3):
        check(q, kc, vc, tables, lens, 0.125, op=op, num_threads=threads)


def test_peaked_softmax():
    """Large logits: the running max changes across tiles and blocks."""
    q, kc, vc, bt, sl = make_inputs([300, 45, 1], 4, 2, 64, 16, torch.float32, seed=3, q_scale=30.0)
    check(q, kc, vc, bt, sl, 0.125)


@pytest.mark.parametrize("h,kvh", [(4, 4), (9, 3), (8, 2), (16, 2)])  # GQA groups 1, 3, 4, 8
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_peaked_softmax(op, h, kvh, d):
    """bf16 (vdpbf16ps scores and P @ V, permuted accumulators) under large logits, so the running max
    grows across spans and the accumulators are rescaled; odd lengths, one and two threads."""
    q, kc, vc, bt, sl = make_inputs([300, 45, 1, 33, 97], h, kvh, d, 16, torch.bfloat16, seed=h + d, q_scale=30.0)
    for num_threads in (1, 2):
        check(q, kc, vc, bt, sl, 1 / math.sqrt(d), op=op, num_threads=num_threads)


def test_strided_caches_and_tables():
    """Caches that are views of a larger tensor (per-layer slice, K and V interleaved) and a
    block table that is a column slice of a wider one."""
    dtype, bs, kvh, d, h = torch.bfloat16, 16, 2, 64, 6
    q, kc, vc, bt, sl = make_inputs([50, 3, 130], h, kvh, d, bs, dtype, seed=9)
    kv = torch.full((kc.shape[0], 2, bs, kvh, d), float("nan"), dtype=dtype)
    kv[:, 0] = kc
    kv[:, 1] = vc
    wide = torch.full((bt.shape[0], bt.shape[1] + 5), -1, dtype=torch.int32)
    wide[:, :bt.shape[1]] = bt
    out = check(q, kv[:, 0], kv[:, 1], wide[:, :bt.shape[1]], sl, 0.125)
    assert kv[:, 0].stride(0) == 2 * bs * kvh * d and out.shape == q.shape


def test_empty_sequence_and_empty_batch():
    q, kc, vc, bt, sl = make_inputs([0, 5], 4, 2, 64, 16, torch.float32, seed=1)
    out = check(q, kc, vc, bt, sl, 0.125)
    assert (out[0] == 0).all()
    e = paged_decode_attention(q[:0], kc, vc, bt[:0], sl[:0], 0.125)
    assert e.shape == (0, 4, 64)


def test_int64_metadata_is_accepted():
    q, kc, vc, bt, sl = make_inputs([20, 3], 4, 2, 64, 16, torch.float32, seed=2)
    out = paged_decode_attention(q, kc, vc, bt.long(), sl.long(), 0.125)
    torch.testing.assert_close(out.double(), reference(q, kc, vc, bt, sl, 0.125), **TOL[torch.float32])


def test_bad_arguments_raise():
    q, kc, vc, bt, sl = make_inputs([20, 3], 4, 2, 64, 16, torch.float32, seed=2)
    bad = bt.clone()
    bad[0, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_attention(q, kc, vc, bad, sl, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        paged_decode_attention(q, kc, vc, bt, torch.tensor([20, 10_000], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="multiple"):
        paged_decode_attention(q[:, :3].contiguous(), kc, vc, bt, sl, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        paged_decode_attention(q.bfloat16(), kc, vc, bt, sl, 0.125)


def f8_values(cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A one-byte (float8_e5m2 or float8_e4m3fn) cache's values as the kernels read them with queries
    of ``dtype``, in that dtype (every e5m2 and e4m3 value is a bf16 one): subnormal codes as zero
    where the build's bf16 dot products flush them, else as they are (infinities and NaNs stay, so a
    read of a poisoned slot still shows)."""
    values = cache.to(dtype)
    if not decode_f8_flushes_subnormals(dtype):
        return values
    exponent = 0x7C if cache.dtype == torch.float8_e5m2 else 0x78
    return values.masked_fill((cache.view(torch.uint8) & exponent) == 0, 0.0)


# The one-byte caches: vLLM's kv_cache_dtype "fp8_e5m2" and "fp8" / "fp8_e4m3".
F8_DTYPES = [torch.float8_e5m2, torch.float8_e4m3fn]
F8_IDS = ["e5m2", "e4m3"]


def f8_name(f8: torch.dtype) -> str:
    return str(f8).removeprefix("torch.")


F8_SHAPES = [(9, 3, 64), (4, 4, 64), (12, 1, 64), (8, 2, 128), (4, 2, 80)]


@pytest.mark.parametrize("h,kvh,d", F8_SHAPES, ids=[f"{h}x{kvh}x{d}" for h, kvh, d in F8_SHAPES])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("f8", F8_DTYPES, ids=F8_IDS)
def test_one_byte_cache_gives_the_bits_of_a_cache_of_its_values(op, h, kvh, d, num_threads, dtype, f8):
    """bf16 or float32 queries on float8_e5m2 or float8_e4m3fn caches (vLLM's
    ``kv_cache_dtype="fp8_e5m2"`` and ``"fp8"``: one byte a value) give bitwise what the kernel gives
    on caches of q's dtype holding the codes' values (subnormal codes read as zero where the build's
    dot products flush them; AVX2 builds widen every code exactly): every span path (SmolLM2's
    paired tokens with all kv heads' queries in registers, one token a vector, head_dim 128 and 80
    with its half-width chunk, more query heads than a pass takes), split contexts, a speculative
    step's grouped rows and the poisoned slots a wrong read would bring in. Where the build cannot
    read such caches with q's dtype (float32 q: AVX2 builds only) the op refuses them."""
    q, kc, vc, bt, sl = make_inputs(LENS + [3000, 0, 1500], h, kvh, d, 16, dtype, seed=h + d)
    kc8, vc8 = kc.to(f8), vc.to(f8)
    kc8.view(torch.uint8)[0, 0, 0, :4] = torch.tensor([0x01, 0x82, 0x03, 0x00], dtype=torch.uint8)  # subnormals
    out = torch.empty_like(q)
    if not decode_supports_f8(dtype):
        with pytest.raises(RuntimeError, match=f"a {f8_name(f8)} cache with .* q needs a CPU with AVX512-BF16"):
            op(q, kc8, vc8, bt, sl, 0.125, out, num_threads)
        return
    op(q, kc8, vc8, bt, sl, 0.125, out, num_threads)
    want = torch.empty_like(q)
    kv = f8_values(kc8, dtype), f8_values(vc8, dtype)
    op(q, *kv, bt, sl, 0.125, want, num_threads)
    assert not want.isnan().any()
    assert torch.equal(out, want)
    torch.testing.assert_close(out.double(), reference(q, *kv, bt, sl, 0.125), **TOL[dtype])
    # A speculative step's rows, grouped into one item, and each row alone.
    qs, kcs, vcs, bts, sls = speculative_rows([1, 30, 63, 100], 3, 16, dtype, seed=d)
    kcs8, vcs8 = kcs.to(f8), vcs.to(f8)
    grouped, alone = torch.empty_like(qs), torch.empty_like(qs)
    op(qs, kcs8, vcs8, bts, sls, 0.125, grouped, num_threads)
    for i in range(qs.shape[0]):
        op(qs[i:i + 1], kcs8, vcs8, bts[i:i + 1], sls[i:i + 1], 0.125, alone[i:i + 1], num_threads)
    want = torch.empty_like(qs)
    op(qs, f8_values(kcs8, dtype), f8_values(vcs8, dtype), bts, sls, 0.125, want, num_threads)
    assert torch.equal(grouped, alone) and torch.equal(grouped, want)


@pytest.mark.parametrize("f8", F8_DTYPES, ids=F8_IDS)
def test_one_byte_cache_arguments(op, f8):
    """A one-byte cache takes bf16 or float32 queries only, both caches in it (of one format), in
    decode and prefill alike. Each refusal names what it wants."""
    q, kc, vc, bt, sl = make_inputs([20, 3], 9, 3, 64, 16, torch.bfloat16, seed=2)
    kc8, vc8 = kc.to(f8), vc.to(f8)
    other = vc.to(F8_DTYPES[1 - F8_DTYPES.index(f8)])
    qs = torch.tensor([0, 1, 2], dtype=torch.int32)
    for call in (lambda *a: paged_decode_attention(*a, bt, sl, 0.125),
                 lambda *a: paged_prefill_attention(*a, bt, qs, sl, 0.125)):
        with pytest.raises(RuntimeError, match=f"a {f8_name(f8)} cache takes bfloat16 or float32 q, got Half"):
            call(q.half(), kc8, vc8)
        with pytest.raises(RuntimeError, match="key_cache and value_cache must share a dtype"):
            call(q, kc8, vc8.view(torch.uint8))
        with pytest.raises(RuntimeError, match="key_cache and value_cache must share a dtype"):
            call(q, kc8, other)


def int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A cache of values [..., D] as an int8 cache [..., D + 4] (codes and a scale a row); rows
    holding NaN (make_inputs' poisoned slots) get a NaN scale, so a read of one still shows."""
    rows = quantize_int8_rows(cache)
    poisoned = cache.isnan().any(-1)
    rows[..., -INT8_ROW_SCALE_BYTES:][poisoned] = torch.tensor([float("nan")]).view(torch.int8)
    return rows


@pytest.mark.parametrize("h,kvh,d", F8_SHAPES, ids=[f"{h}x{kvh}x{d}" for h, kvh, d in F8_SHAPES])
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_cache_decode_matches_the_reference_on_its_values(op, h, kvh, d, num_threads, dtype):
    """bf16 or float32 queries on an int8 cache (each (token, kv head) row: head_dim codes and a
    float32 scale, its largest magnitude / 127): the output is softmax(q k^T) v on the rows' values
    (codes x scale) within q's dtype's tolerance, on every span path (SmolLM2's paired tokens, one
    token a vector, head_dim 128 and 80 with its half-width chunk, more query heads than a pass),
    split contexts and the poisoned slots; a speculative step's grouped rows give each row's own
    bits. Builds that cannot read it with q's dtype refuse it."""
    q, kc, vc, bt, sl = make_inputs(LENS + [3000, 0, 1500], h, kvh, d, 16, dtype, seed=h + d)
    kc8, vc8 = int8_cache(kc), int8_cache(vc)
    out = torch.empty_like(q)
    if not decode_supports_int8(dtype):
        with pytest.raises(RuntimeError, match="an int8 cache with .* q needs a CPU with AVX512-BF16"):
            op(q, kc8, vc8, bt, sl, 0.125, out, num_threads)
        return
    op(q, kc8, vc8, bt, sl, 0.125, out, num_threads)
    assert not out.isnan().any()
    want = reference(q, dequantize_int8_rows(kc8), dequantize_int8_rows(vc8), bt, sl, 0.125)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    qs, kcs, vcs, bts, sls = speculative_rows([1, 30, 63, 100], 3, 16, dtype, seed=d)
    kcs8, vcs8 = int8_cache(kcs), int8_cache(vcs)
    grouped, alone = torch.empty_like(qs), torch.empty_like(qs)
    op(qs, kcs8, vcs8, bts, sls, 0.125, grouped, num_threads)
    for i in range(qs.shape[0]):
        op(qs[i:i + 1], kcs8, vcs8, bts[i:i + 1], sls[i:i + 1], 0.125, alone[i:i + 1], num_threads)
    assert torch.equal(grouped, alone)
    torch.testing.assert_close(grouped.double(), reference(qs, dequantize_int8_rows(kcs8), dequantize_int8_rows(vcs8),
                                                           bts, sls, 0.125), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_cache_scales_reach_scores_and_values(op, dtype):
    """Rows of one sequence whose K and V are the same values at scales 2^-4 .. 2^4 apart (as a
    model's K/V grow and shrink token to token): each token's K scale must multiply its score and
    its V scale its value, or the softmax picks other tokens and the output lands elsewhere."""
    if not decode_supports_int8(dtype):
        pytest.skip("this build does not read int8 caches with these queries: the refusal is checked above")
    g = torch.Generator().manual_seed(5)
    n, kvh, d, bs = 96, 3, 64, 16
    base_k = torch.randn(n, kvh, d, generator=g)
    base_v = torch.randn(n, kvh, d, generator=g)
    mag = 2.0 ** torch.randint(-4, 5, (n, kvh, 1), generator=g)
    kc = (base_k * mag).to(dtype).view(n // bs, bs, kvh, d)
    vc = (base_v * mag.flip(0)).to(dtype).view(n // bs, bs, kvh, d)
    q = (torch.randn(1, 9, d, generator=g) * 2).to(dtype)
    bt = torch.arange(n // bs, dtype=torch.int32).view(1, -1)
    sl = torch.tensor([n], dtype=torch.int32)
    out = torch.empty_like(q)
    kc8, vc8 = int8_cache(kc), int8_cache(vc)
    op(q, kc8, vc8, bt, sl, 0.125, out, 1)
    torch.testing.assert_close(out.double(), reference(q, dequantize_int8_rows(kc8), dequantize_int8_rows(vc8), bt, sl,
                                                       0.125), **TOL[dtype])


@pytest.mark.parametrize("h,kvh,d", F8_SHAPES, ids=[f"{h}x{kvh}x{d}" for h, kvh, d in F8_SHAPES])
def test_int8_cache_bf16_output_is_as_close_as_its_rounding_allows(op, h, kvh, d):
    """bf16 queries on an int8 cache: the kernel takes Q K^T and P V in integer dot products (the
    queries as two int8 digits, P as int16 multiples of its largest / 32767), finer than bf16
    operands, so its output misses the exact attention on the rows' values by no more than that
    result's own rounding to bf16 does (on average; P rounded to bf16 misses by ~1.5x that)."""
    if not decode_supports_int8(torch.bfloat16):
        pytest.skip("this build does not read int8 caches with bf16 queries: the refusal is checked above")
    q, kc, vc, bt, sl = make_inputs([700, 513, 64, 300, 1000, 33], h, kvh, d, 16, torch.bfloat16, poison=False,
                                    seed=d + h, q_scale=6.0)
    kc8, vc8 = int8_cache(kc), int8_cache(vc)
    out = torch.empty_like(q)
    op(q, kc8, vc8, bt, sl, 0.125, out, 1)
    want = reference(q, dequantize_int8_rows(kc8), dequantize_int8_rows(vc8), bt, sl, 0.125)
    rounding = (want.to(torch.bfloat16).double() - want).abs().mean()
    assert (out.double() - want).abs().mean() <= 1.1 * rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_cache_writer_stores_the_reference_bytes(dtype):
    """reshape_and_cache into an int8 cache writes each row's codes and scale exactly as
    quantize_int8_rows does (ties to even, a zero row, a row with a NaN, large and tiny values), from
    a strided value view, and touches no other slot; the rows' values are the inputs within half a
    code step."""
    load_extension()
    g = torch.Generator().manual_seed(3)
    kvh, d, nb, bs, t = 3, 64, 20, 16, 50
    qkv = (torch.randn(t, 9 * d + 2 * kvh * d, generator=g) * 3).to(dtype)
    key = qkv[:, 9 * d:(9 + kvh) * d].reshape(t, kvh, d).contiguous()
    value = qkv[:, (9 + kvh) * d:].view(t, kvh, d)
    key[0] = 0
    key[1, 0, 5] = float("nan")
    key[2, 1] *= 1e30 if dtype == torch.float32 else 1e20
    key[3, 2] *= 1e-30
    key[4, 0, :4] = torch.tensor([63.5, -0.5, 2.5, 127.0]).to(dtype)  # ties at amax 127: nearest even
    key[4, 0, 4:] = 0
    slots = torch.randperm(nb * bs, generator=g)[:t]
    kc = torch.randint(-128, 128, (nb, bs, kvh, d + INT8_ROW_SCALE_BYTES), generator=g, dtype=torch.int8)
    vc = kc.clone()
    before = kc.clone()
    torch.ops.pagoda_cpu.reshape_and_cache(key, value, kc, vc, slots)
    flat_k, flat_v = kc.view(-1, kvh, d + 4), vc.view(-1, kvh, d + 4)
    assert torch.equal(flat_k[slots], quantize_int8_rows(key))
    assert torch.equal(flat_v[slots], quantize_int8_rows(value))
    assert torch.equal(flat_k[slots[4], 0, :4], torch.tensor([64, 0, 2, 127], dtype=torch.int8))
    untouched = torch.ones(nb * bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(kc.view(-1, kvh, d + 4)[untouched], before.view(-1, kvh, d + 4)[untouched])
    values = dequantize_int8_rows(flat_v[slots])
    step = value.float().abs().amax(-1, keepdim=True) / 127
    assert ((values - value.float()).abs() <= step * (0.5 + 1e-4)).all()  # (float32 rounding of x / scale)


def test_int8_cache_backend_writes_match_the_torch_path():
    """CpuAttention().write_kv into int8 caches (the C++ writer; a layout it does not take, heads
    not adjacent, goes through torch's index_copy_) stores what write_kv's torch path stores."""
    g = torch.Generator().manual_seed(4)
    kvh, d, nb, bs, t = 3, 64, 10, 16, 40
    key = torch.randn(t, kvh, d, generator=g).to(torch.bfloat16)
    value = torch.randn(t, d, kvh, generator=g).to(torch.bfloat16).transpose(1, 2)  # heads not adjacent
    slots = torch.randperm(nb * bs, generator=g)[:t]
    caches = [torch.zeros(nb, bs, kvh, d + INT8_ROW_SCALE_BYTES, dtype=torch.int8) for _ in range(4)]
    CpuAttention().write_kv(key, value, caches[0], caches[1], slots)
    CpuAttention().write_kv(key, value.contiguous(), caches[2], caches[3], slots)
    ref_k, ref_v = (torch.zeros_like(caches[0]) for _ in range(2))
    write_kv(key, value, ref_k, ref_v, slots)
    assert ref_v.any() and all(torch.equal(c, r) for c, r in zip(caches, (ref_k, ref_v, ref_k, ref_v)))


def test_int8_cache_arguments(op):
    """An int8 cache's last dim is head_dim + 4 (codes and a scale) and it takes bf16 or float32
    queries; the writer and the kernels say so."""
    load_extension()
    q, kc, vc, bt, sl = make_inputs([20, 3], 9, 3, 64, 16, torch.bfloat16, seed=2)
    kc8, vc8 = int8_cache(kc), int8_cache(vc)
    qs = torch.tensor([0, 1, 2], dtype=torch.int32)
    if decode_supports_int8(torch.bfloat16):
        with pytest.raises(RuntimeError, match="an int8 cache's rows are head_dim \\(64\\) codes and a float32 "
                                               "scale: last dim 68, got 64"):
            paged_decode_attention(q, kc8[..., :64].contiguous(), vc8[..., :64].contiguous(), bt, sl, 0.125)
    for call in (lambda *a: paged_decode_attention(*a, bt, sl, 0.125),
                 lambda *a: paged_prefill_attention(*a, bt, qs, sl, 0.125)):
        with pytest.raises(RuntimeError, match="an int8 cache takes bfloat16 or float32 q, got Half"):
            call(q.half(), kc8, vc8)
        with pytest.raises(RuntimeError, match="key_cache and value_cache must share a dtype"):
            call(q, kc8, vc8.view(torch.uint8))
    with pytest.raises(RuntimeError, match="key / value must be"):
        torch.ops.pagoda_cpu.reshape_and_cache(kc[:2, 0], kc[:2, 0], kc8[..., :60].contiguous(),
                                               vc8[..., :60].contiguous(), torch.tensor([0, 1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_decode_matches_torch_backend(dtype):
    """CpuAttention().decode == TorchAttention().decode on metadata built as the runner builds it."""
    g = torch.Generator().manual_seed(7)
    bs, h, kvh, d = 16, 9, 3, 64
    lens = [1, 17, 40, 95, 16]
    max_blocks = max((n + bs - 1) // bs for n in lens) + 1
    num_blocks = len(lens) * max_blocks + 4
    perm = torch.randperm(num_blocks, generator=g)
    block_tables = perm[:len(lens) * max_blocks].view(len(lens), max_blocks).int()
    key_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    # This step's new tokens: written into their slots first, as each layer does.
    pos = seq_lens.long() - 1
    slot_mapping = block_tables.long()[torch.arange(len(lens)), pos // bs] * bs + pos % bs
    write_kv(torch.randn(len(lens), kvh, d, generator=g).to(dtype), torch.randn(len(lens), kvh, d, generator=g).to(dtype),
             key_cache, value_cache, slot_mapping)
    meta = AttentionMetadata(
        slot_mapping=slot_mapping, num_decode_tokens=len(lens), decode_block_tables=block_tables,
        decode_seq_lens=seq_lens, num_prefills=0, prefill_query_lens=torch.zeros(0, dtype=torch.long),
        prefill_seq_lens=torch.zeros(0, dtype=torch.long),
        prefill_block_tables=torch.zeros(0, max_blocks, dtype=torch.int32), max_decode_seq_len=max(lens))
    q = torch.randn(len(lens), h, d, generator=g).to(dtype)
    ref_backend, cpu_backend = TorchAttention(), CpuAttention()
    assert cpu_backend.name == "cpu"
    ref_backend.prepare(meta, bs)
    expected = ref_backend.decode(q, key_cache, value_cache, meta, 1 / math.sqrt(d))
    cpu_backend.prepare(meta, bs)
    got = cpu_backend.decode(q, key_cache, value_cache, meta, 1 / math.sqrt(d))
    assert got.dtype == dtype and got.shape == q.shape
    # TorchAttention rounds the probabilities to bf16 before P @ V; the kernel keeps them in fp32.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(got.double(), reference(q, key_cache, value_cache, block_tables, seq_lens,
                                                       1 / math.sqrt(d)), **TOL[dtype])


# ---------------------------------------------------------------------------------------------
# Prefill / chunked prefill
# ---------------------------------------------------------------------------------------------

PREFILL_DTYPES = [d for d in (torch.float32, torch.bfloat16) if prefill_supported(d)]
needs_prefill = pytest.mark.skipif(not PREFILL_DTYPES, reason="no C++ prefill kernel on this CPU")


def _prefill_amx_available() -> bool:
    if torch.bfloat16 not in PREFILL_DTYPES:
        return False
    load_extension()
    return bool(torch.ops.pagoda_cpu.set_prefill_amx(True))


# (dtype, AMX panels): the bf16 kernel runs on AMX tiles where the CPU has them (the default) and
# on AVX512_BF16 vectors otherwise; on an AMX host both paths are checked.
PREFILL_AMX = _prefill_amx_available()
PREFILL_VARIANTS = [(d, False) for d in PREFILL_DTYPES] + ([(torch.bfloat16, True)] if PREFILL_AMX else [])
PREFILL_VARIANT_IDS = [f"{str(d).removeprefix('torch.')}{'-amx' if amx else ''}" for d, amx in PREFILL_VARIANTS]


@pytest.fixture
def prefill_variant(request):
    """The dtype of a PREFILL_VARIANTS entry, with the kernel's AMX switch set for it."""
    dtype, amx = request.param
    if PREFILL_DTYPES:
        torch.ops.pagoda_cpu.set_prefill_amx(amx)
    yield dtype
    if PREFILL_DTYPES:
        torch.ops.pagoda_cpu.set_prefill_amx(True)


def each_prefill_variant():
    """Iterate the variants inside one test (the AMX switch set for each, restored after)."""
    try:
        for dtype, amx in PREFILL_VARIANTS:
            torch.ops.pagoda_cpu.set_prefill_amx(amx)
            yield dtype
    finally:
        if PREFILL_DTYPES:
            torch.ops.pagoda_cpu.set_prefill_amx(True)


def test_prefill_uses_amx_where_the_cpu_has_it():
    """AMX is the bf16 prefill path on CPUs with AMX-BF16 (Linux grants the tile state), and off elsewhere."""
    flags = build_cpu_flags()
    cpu_has_amx = "amx_bf16" in flags and "amx_tile" in flags and torch.bfloat16 in PREFILL_DTYPES
    assert PREFILL_AMX == cpu_has_amx
    if PREFILL_AMX:
        assert torch.ops.pagoda_cpu.set_prefill_amx(False) is False
        assert torch.ops.pagoda_cpu.set_prefill_amx(True) is True


def prefill_reference(q, key_cache, value_cache, block_tables, query_start, seq_lens, scale):
    """float64: query i of a chunk of length L in a sequence of length S attends to keys 0 .. S - L + i,
    read through the sequence's block table."""
    t, h, d = q.shape
    bs, kvh = key_cache.shape[1], key_cache.shape[2]
    out = torch.zeros(t, h, d, dtype=torch.float64)
    for i in range(len(seq_lens)):
        q0, q1, n = int(query_start[i]), int(query_start[i + 1]), int(seq_lens[i])
        if q1 == q0:
            continue
        pos = torch.arange(n)
        blocks = block_tables[i].long()[pos // bs]
        k = key_cache[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)  # [n, h, d]
        v = value_cache[blocks, pos % bs].double().repeat_interleave(h // kvh, dim=1)
        s = torch.einsum("lhd,nhd->hln", q[q0:q1].double(), k) * scale
        visible = pos[None, :] <= (n - (q1 - q0) + torch.arange(q1 - q0))[:, None]
        s = s.masked_fill(~visible[None], float("-inf"))
        out[q0:q1] = torch.einsum("hln,nhd->lhd", s.softmax(-1), v)
    return out


def make_prefill_inputs(chunks, h, kvh, d, bs, dtype, seed=0, extra_blocks=5, table_pad=2, q_scale=2.0):
    """chunks: (cached context, query length) per sequence. The caches hold random K/V for every token
    of every sequence (context and chunk alike: the layer writes the chunk before attending), in
    shuffled blocks; NaN everywhere the kernel must not read (unused blocks, slots past a sequence's
    end, padded table entries)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in chunks]
    nblk = [-(-n // bs) for n in seq_lens]
    used = sum(nblk)
    perm = torch.randperm(used + extra_blocks, generator=g)
    key_cache = torch.randn(used + extra_blocks, bs, kvh, d, generator=g).to(dtype)
    value_cache = torch.randn(used + extra_blocks, bs, kvh, d, generator=g).to(dtype)
    block_tables = torch.full((len(chunks), max(nblk + [1]) + table_pad), int(perm[used]), dtype=torch.int32)
    at = 0
    for i, n in enumerate(nblk):
        ids = perm[at:at + n]
        at += n
        block_tables[i, :n] = ids.int()
        tail = seq_lens[i] - (n - 1) * bs
        if n and tail < bs:
            key_cache[ids[-1], tail:] = float("nan")
            value_cache[ids[-1], tail:] = float("nan")
    key_cache[perm[used:]] = float("nan")
    value_cache[perm[used:]] = float("nan")
    q = (torch.randn(sum(n for _, n in chunks), h, d, generator=g) * q_scale).to(dtype)
    query_start = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    query_start[1:] = torch.tensor([n for _, n in chunks]).cumsum(0)
    return q, key_cache, value_cache, block_tables, query_start, torch.tensor(seq_lens, dtype=torch.int32)


def check_prefill(q, key_cache, value_cache, block_tables, query_start, seq_lens, scale, op=None, num_threads=None,
                  out=None):
    if out is None:
        out = torch.full_like(q, float("nan"))
    else:
        out.fill_(float("nan"))
    if op is None:
        res = paged_prefill_attention(q, key_cache, value_cache, block_tables, query_start, seq_lens, scale, out=out)
        assert res is out
    else:
        op(q, key_cache, value_cache, block_tables, query_start, seq_lens, scale, out, num_threads)
    ref = prefill_reference(q, key_cache, value_cache, block_tables, query_start, seq_lens, scale)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, **TOL[q.dtype])
    return out


# Query lengths 1 and ones that are not multiples of a query tile (128 / group tokens) or of the
# 64-key tile, with and without cached context, and an empty chunk.
PREFILL_CHUNKS = [(0, 1), (0, 37), (5, 1), (100, 20), (0, 130), (64, 64), (3, 200), (10, 0), (17, 63)]


@pytest.fixture(scope="module")
def prefill_op():
    load_extension()
    return torch.ops.pagoda_cpu.paged_prefill_attention.default


@needs_prefill
@pytest.mark.parametrize("prefill_variant", PREFILL_VARIANTS, ids=PREFILL_VARIANT_IDS, indirect=True)
@pytest.mark.parametrize("h,kvh", [(4, 4), (9, 3), (8, 2)])  # GQA groups 1, 3, 4
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
def test_prefill_matches_reference(prefill_variant, h, kvh, d, bs):
    dtype = prefill_variant
    inputs = make_prefill_inputs(PREFILL_CHUNKS, h, kvh, d, bs, dtype, seed=h * 100 + d + bs)
    check_prefill(*inputs, 1 / math.sqrt(d))


@needs_prefill
@pytest.mark.parametrize("d", [80, 96])
def test_prefill_other_head_sizes(d):
    for dtype in each_prefill_variant():
        inputs = make_prefill_inputs([(0, 45), (30, 7), (0, 1)], 6, 2, d, 16, dtype, seed=d)
        check_prefill(*inputs, 1 / math.sqrt(d))


@needs_prefill
@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_prefill_thread_counts_and_long_context(prefill_op, num_threads):
    """A long chunk after a long context next to short ones (many key tiles, items of very different
    sizes), with logits large enough that the running max changes across key tiles (at q_scale 8 a
    float32 torch softmax is itself ~2e-5 off the float64 reference)."""
    for dtype in each_prefill_variant():
        inputs = make_prefill_inputs([(700, 300), (0, 3), (40, 90)], 12, 4, 64, 16, dtype, seed=num_threads,
                                     q_scale=4.0)
        check_prefill(*inputs, 0.125, op=prefill_op, num_threads=num_threads)


@needs_prefill
def test_prefill_strided_q_and_out():
    """q as a view of a wider projection output (token stride > H * D), out likewise."""
    dtype = PREFILL_DTYPES[-1]
    q, kc, vc, bt, qs, sl = make_prefill_inputs([(20, 33), (0, 17)], 6, 2, 64, 16, dtype, seed=4)
    wide = torch.full((q.shape[0], q.shape[1] + 3, q.shape[2]), float("nan"), dtype=dtype)
    wide[:, :6] = q
    out_wide = torch.empty_like(wide)
    out = check_prefill(wide[:, :6], kc, vc, bt, qs, sl, 0.125, out=out_wide[:, :6])
    assert out.data_ptr() == out_wide.data_ptr()


@needs_prefill
def test_prefill_bad_arguments_raise():
    q, kc, vc, bt, qs, sl = make_prefill_inputs([(4, 20), (0, 3)], 4, 2, 64, 16, torch.float32, seed=2)
    bad = bt.clone()
    bad[0, 1] = kc.shape[0]
    with pytest.raises(RuntimeError, match="out of range"):
        paged_prefill_attention(q, kc, vc, bad, qs, sl, 0.125)
    with pytest.raises(RuntimeError, match="inconsistent"):  # a chunk longer than its sequence
        paged_prefill_attention(q, kc, vc, bt, qs, torch.tensor([24, 2], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="query_start_loc"):
        paged_prefill_attention(q, kc, vc, bt, torch.tensor([0, 20, 22], dtype=torch.int32), sl, 0.125)
    with pytest.raises(RuntimeError, match="dtype"):
        paged_prefill_attention(q.double(), kc, vc, bt, qs, sl, 0.125)


def _runner_prefill_meta(chunks, bs, max_blocks, block_tables):
    """AttentionMetadata for a prefill-only step as the model runner builds it."""
    qlens = torch.tensor([n for _, n in chunks])
    seq_lens = torch.tensor([c + n for c, n in chunks])
    seq_idx = torch.repeat_interleave(torch.arange(len(chunks)), qlens)
    cu = torch.zeros(len(chunks) + 1, dtype=torch.long)
    cu[1:] = qlens.cumsum(0)
    pos = (seq_lens - qlens)[seq_idx] + torch.arange(int(qlens.sum())) - cu[seq_idx]
    slot_mapping = block_tables.long()[seq_idx, pos // bs] * bs + pos % bs
    return AttentionMetadata(
        slot_mapping=slot_mapping, num_decode_tokens=0, decode_block_tables=torch.zeros(0, max_blocks, dtype=torch.int32),
        decode_seq_lens=torch.zeros(0, dtype=torch.int32), num_prefills=len(chunks), prefill_query_lens=qlens,
        prefill_seq_lens=seq_lens, prefill_block_tables=block_tables, max_prefill_query_len=int(qlens.max()),
        max_prefill_seq_len=int(seq_lens.max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_prefill_matches_torch_backend(dtype):
    """CpuAttention().prefill == TorchAttention().prefill on metadata built as the runner builds it:
    first chunks and later chunks in one step, the chunk's K/V written into the cache first (fp16, or
    a CPU without the kernel, takes the torch path)."""
    g = torch.Generator().manual_seed(8)
    bs, h, kvh, d = 16, 9, 3, 64
    chunks = [(0, 40), (48, 16), (0, 1), (100, 70), (33, 5)]
    max_blocks = max(-(-(c + n) // bs) for c, n in chunks) + 1
    num_blocks = len(chunks) * max_blocks + 4
    block_tables = torch.randperm(num_blocks, generator=g)[:len(chunks) * max_blocks].view(len(chunks), max_blocks).int()
    key_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    value_cache = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    meta = _runner_prefill_meta(chunks, bs, max_blocks, block_tables)
    t = int(meta.prefill_query_lens.sum())
    q = torch.randn(t, h, d, generator=g).to(dtype)
    k = torch.randn(t, kvh, d, generator=g).to(dtype)
    v = torch.randn(t, kvh, d, generator=g).to(dtype)
    write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
    ref_backend, cpu_backend = TorchAttention(), CpuAttention()
    ref_backend.prepare(meta, bs)
    expected = ref_backend.prefill(q, k, v, key_cache, value_cache, meta, 1 / math.sqrt(d))
    cpu_backend.prepare(meta, bs)
    got = cpu_backend.prefill(q, k, v, key_cache, value_cache, meta, 1 / math.sqrt(d))
    assert got.dtype == dtype and got.shape == q.shape
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, expected, **tol)
    query_start = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    query_start[1:] = meta.prefill_query_lens.cumsum(0)
    torch.testing.assert_close(got.double(), prefill_reference(q, key_cache, value_cache, block_tables, query_start,
                                                               meta.prefill_seq_lens, 1 / math.sqrt(d)), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 300])
def test_backend_write_kv_matches_index_copy(dtype, num_tokens):
    """The C++ reshape_and_cache writes exactly what write_kv's index_copy_ writes, from a strided
    value view (the fused QKV output) and scattered slots, and touches no other slot."""
    torch.manual_seed(num_tokens)
    kvh, d, nb, bs = 3, 64, 40, 16
    qkv = torch.randn(num_tokens, 9 * d + 2 * kvh * d).to(dtype)
    key = qkv[:, 9 * d:(9 + kvh) * d].reshape(num_tokens, kvh, d).contiguous()
    value = qkv[:, (9 + kvh) * d:].view(num_tokens, kvh, d)
    slots = torch.randperm(nb * bs)[:num_tokens]
    poison = torch.randn(nb, bs, kvh, d).to(dtype)
    kc, vc, kc_ref, vc_ref = (poison.clone() for _ in range(4))
    CpuAttention().write_kv(key, value, kc, vc, slots)
    write_kv(key, value, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    flat = kc.view(-1, kvh, d)
    assert torch.equal(flat[slots], key) and torch.equal(vc.view(-1, kvh, d)[slots], value)


def test_reshape_and_cache_refuses_bad_slots_and_shapes():
    load_extension()
    op = torch.ops.pagoda_cpu.reshape_and_cache
    kc = torch.zeros(4, 16, 2, 64)
    vc = torch.zeros_like(kc)
    k = torch.randn(3, 2, 64)
    with pytest.raises(RuntimeError, match="slot 64 outside the cache"):
        op(k, k, kc, vc, torch.tensor([0, 1, 64]))
    with pytest.raises(RuntimeError, match="slot -1 outside"):
        op(k, k, kc, vc, torch.tensor([0, -1, 2]))
    with pytest.raises(RuntimeError, match="key / value must be"):
        op(torch.randn(3, 4, 32), k, kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        op(k, k, kc, vc, torch.tensor([0, 1, 2], dtype=torch.int32))
    assert not kc.any() and not vc.any()  # nothing written by a refused call


@needs_prefill
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("f8", F8_DTYPES, ids=F8_IDS)
def test_one_byte_cache_prefill_gives_the_bits_of_a_cache_of_its_values(prefill_op, dtype, f8):
    """The prefill kernel on float8_e5m2 or float8_e4m3fn caches (each key tile's codes turned into
    values of q's dtype first) gives bitwise what it gives on caches of q's dtype holding the codes'
    values as decode reads them: on AMX tiles and on vectors, chunks with and without cached context,
    the poisoned slots a wrong read would bring in. Where the build cannot read such caches with q's
    dtype it refuses them."""
    chunks = PREFILL_CHUNKS + [(300, 90)]
    q, kc, vc, bt, qs, sl = make_prefill_inputs(chunks, 9, 3, 64, 16, dtype, seed=5)
    kc8, vc8 = kc.to(f8), vc.to(f8)
    kc8.view(torch.uint8)[int(bt[0, 0]), 0, 0, :3] = torch.tensor([0x01, 0x83, 0x00], dtype=torch.uint8)
    out = torch.empty_like(q)
    if not decode_supports_f8(dtype):
        with pytest.raises(RuntimeError, match=f"a {f8_name(f8)} cache with .* q needs a CPU with AVX512-BF16"):
            prefill_op(q, kc8, vc8, bt, qs, sl, 0.125, out, 2)
        return
    for _ in each_prefill_variant() if dtype in PREFILL_DTYPES else ():
        for threads in (1, 2):
            prefill_op(q, kc8, vc8, bt, qs, sl, 0.125, out, threads)
            want = check_prefill(q, f8_values(kc8, dtype), f8_values(vc8, dtype), bt, qs, sl, 0.125,
                                 op=prefill_op, num_threads=threads)
            assert torch.equal(out, want)


@needs_prefill
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_int8_cache_prefill_gives_the_bits_of_a_cache_of_its_values(prefill_op, dtype):
    """The prefill kernel on int8 caches (each key tile's rows turned into code x scale in q's dtype
    first, rounded to nearest even) gives bitwise what it gives on caches of q's dtype holding those
    values: on AMX tiles and on vectors, chunks with and without cached context, the poisoned slots
    a wrong read would bring in. Builds that cannot read them with q's dtype refuse them."""
    chunks = PREFILL_CHUNKS + [(300, 90)]
    q, kc, vc, bt, qs, sl = make_prefill_inputs(chunks, 9, 3, 64, 16, dtype, seed=5)
    kc8, vc8 = int8_cache(kc), int8_cache(vc)
    out = torch.empty_like(q)
    if not decode_supports_int8(dtype):
        with pytest.raises(RuntimeError, match="an int8 cache with .* q needs a CPU with AVX512-BF16"):
            prefill_op(q, kc8, vc8, bt, qs, sl, 0.125, out, 2)
        return
    values = dequantize_int8_rows(kc8).to(dtype), dequantize_int8_rows(vc8).to(dtype)
    for _ in each_prefill_variant() if dtype in PREFILL_DTYPES else ():
        for threads in (1, 2):
            prefill_op(q, kc8, vc8, bt, qs, sl, 0.125, out, threads)
            want = check_prefill(q, *values, bt, qs, sl, 0.125, op=prefill_op, num_threads=threads)
            assert torch.equal(out, want)
