"""The fused C++ layer ops (residual add + RMSNorm, rotary, silu_and_mul) against the torch reference ops."""
from __future__ import annotations

import math

import pytest
import torch

from pagoda_kernels.attention import to_cache_dtype
from pagoda_kernels.cpu_attention import build_cpu_flags
from pagoda_kernels.layer_ops import CpuLayerOps, TorchLayerOps

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    return CpuLayerOps(), TorchLayerOps()


def ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference in units of the dtype's last place at the reference's magnitude."""
    eps = torch.finfo(a.dtype).eps
    scale = b.float().abs().clamp_min(1e-3)
    return ((a.float() - b.float()).abs() / (scale * eps)).max().item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 crosses the multi-thread threshold
@pytest.mark.parametrize("hidden", [576, 580])  # 580: a tail after the 16-wide vector loop
def test_rms_norm_with_and_without_residual(ops, dtype, rows, hidden):
    cpu, ref = ops
    g = torch.Generator().manual_seed(rows)
    # A strided x (a view into a wider buffer), as the layer's projections produce.
    x = (3 * torch.randn(rows, hidden + 64, generator=g)).to(dtype)[:, 32:32 + hidden]
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)
    res = torch.randn(rows, hidden, generator=g).to(dtype)
    out = cpu.rms_norm(x, None, w, 1e-5)
    want = ref.rms_norm(x, None, w, 1e-5)
    assert out.shape == want.shape and out.dtype == dtype
    assert ulps(out, want) <= 4  # the mean's float32 summation order differs: ~1 ulp, carried by 2 products
    res_cpu, res_ref = res.clone(), res.clone()
    out = cpu.rms_norm(x, res_cpu, w, 1e-5)
    want = ref.rms_norm(x, res_ref, w, 1e-5)
    assert torch.equal(res_cpu, res_ref)  # the residual add rounds exactly as torch's
    assert not torch.equal(res_cpu, res)
    assert ulps(out, want) <= 4


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("hidden", [576, 580])
def test_rms_norm_of_bf16_into_float32_holds_the_bf16_result(ops, rows, hidden):
    """A float32 out for bf16 x (what the float32 GEMM kernel reads in a bf16 model on a CPU without
    bf16 dot products) holds exactly the bf16 out's values; the residual is updated alike."""
    cpu, _ = ops
    g = torch.Generator().manual_seed(rows + hidden)
    x = (3 * torch.randn(rows, hidden, generator=g)).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(torch.bfloat16)
    res = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    for residual in (None, res):
        r16, r32 = (None, None) if residual is None else (residual.clone(), residual.clone())
        want = cpu.rms_norm(x, r16, w, 1e-5)
        got = torch.empty(rows, hidden)
        torch.ops.pagoda_cpu.rms_norm(x, r32, w, 1e-5, got)
        assert torch.equal(got, want.float())
        assert residual is None or torch.equal(r32, r16)
    with pytest.raises(RuntimeError, match="or be float32 for bf16 x"):
        torch.ops.pagoda_cpu.rms_norm(x.float(), None, w.float(), 1e-5, torch.empty(rows, hidden, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,dim", [(9, 64), (3, 64), (4, 128)])
def test_rotary_matches_torch_exactly(ops, dtype, heads, dim):
    cpu, ref = ops
    g = torch.Generator().manual_seed(heads * dim)
    t, max_pos = 70, 512
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), -1)
    cos_t, sin_t = emb.cos(), emb.sin()
    qkv = torch.randn(t, heads * dim + 40, generator=g).to(dtype)
    x = qkv[:, :heads * dim].view(t, heads, dim)  # strided token rows, contiguous heads
    positions = torch.randint(0, max_pos, (t,), generator=g)
    out = cpu.rotary(x, cpu.rope_inputs(positions, cos_t, sin_t, dtype))
    want = ref.rotary(x, ref.rope_inputs(positions, cos_t, sin_t, dtype))
    assert out.is_contiguous() and out.dtype == dtype
    assert torch.equal(out, want)


def _rope_tables(dim, max_pos):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.arange(max_pos).float()[:, None] * inv[None, :]
    emb = torch.cat((emb, emb), -1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kvh,dim,rows,cached", [(9, 3, 64, 70, 70), (9, 3, 64, 300, 293), (4, 2, 128, 16, 9)])
def test_rotary_qkv_to_cache_is_rotary_then_reshape_and_cache(ops, dtype, heads, kvh, dim, rows, cached):
    """The fused op against its parts, bitwise: rotary(q) for every row, rotary(k) and v at their
    slots for the first `cached` rows only (the rest are GEMM padding), other slots untouched."""
    from pagoda_kernels.cpu_attention import CpuAttention

    cpu, _ = ops
    g = torch.Generator().manual_seed(rows + dim)
    max_pos, blocks, bs = 512, 40, 16
    cos_t, sin_t = _rope_tables(dim, max_pos)
    width = (heads + 2 * kvh) * dim
    qkv = torch.randn(rows, width + 24, generator=g).to(dtype)[:, :width]  # strided rows, as a GEMM view
    positions = torch.randint(0, max_pos, (rows,), generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:cached]
    rope = cpu.rope_inputs(positions, cos_t, sin_t, dtype)
    caches = [torch.randn(blocks, bs, kvh, dim, generator=g).to(dtype) for _ in range(2)]
    kc, vc = caches[0].clone(), caches[1].clone()
    q = cpu.rotary_qkv_to_cache(qkv, rope, heads, kc, vc, slots)

    q_ref, k, v = qkv.split([heads * dim, kvh * dim, kvh * dim], dim=-1)
    q_ref = cpu.rotary(q_ref.view(rows, heads, dim), rope)
    k = cpu.rotary(k.view(rows, kvh, dim), rope)
    kc_ref, vc_ref = caches[0].clone(), caches[1].clone()
    CpuAttention().write_kv(k[:cached], v.reshape(rows, kvh, dim)[:cached], kc_ref, vc_ref, slots)
    assert q.shape == (rows, heads, dim) and q.is_contiguous()
    assert torch.equal(q, q_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert not torch.equal(kc, caches[0])


@pytest.mark.parametrize("f8", [torch.float8_e5m2, torch.float8_e4m3fn], ids=["e5m2", "e4m3"])
def test_one_byte_cache_writers_store_torchs_codes(ops, f8):
    """Into a one-byte cache each C++ writer stores what torch's conversion of its bf16 or float32
    rows gives (float8_e4m3fn: of the rows clamped to +-448, where torch alone gives NaN):
    reshape_and_cache for every one of the 65536 bf16 bit patterns (subnormals, halfway cases,
    overflow, NaN), and for float32 rows those patterns with random low mantissa bits and the exact
    halfway and round-up points below them; and rotary_qkv_to_cache its bf16 or float32 cache's new
    rows converted, every other slot untouched. Rows of another dtype are refused."""
    from pagoda_kernels.cpu_attention import CpuAttention

    cpu, _ = ops
    g = torch.Generator().manual_seed(3)
    key = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(1024, 2, 32)
    value = key.flip(0)
    kc8, vc8 = (torch.zeros(64, 16, 2, 32, dtype=f8) for _ in range(2))
    slots = torch.randperm(1024, generator=g)
    CpuAttention().write_kv(key, value, kc8, vc8, slots)
    # float32 rows: each bf16 pattern with random low 16 bits, exactly halfway to the next code
    # (e5m2: the mantissa's bits 0-20 at 0x100000; e4m3: bits 0-19 at 0x80000), and one above and
    # below halfway.
    half = 0x100000 if f8 == torch.float8_e5m2 else 0x80000
    bits = key.view(torch.int16).to(torch.int32).view(1024, 64) << 16
    low = torch.randint(0, 1 << 16, bits.shape, generator=g, dtype=torch.int32)
    keep = bits & ~(2 * half - 1)
    variants = [bits | low, keep | half, keep | (half + 1), keep | (half - 1)]
    for i, rows32 in enumerate(variants):
        key32 = rows32.view(torch.float32).view(1024, 2, 32)
        value32 = variants[(i + 1) % len(variants)].view(torch.float32).view(1024, 2, 32)
        CpuAttention().write_kv(key32, value32, kc8, vc8, slots)
        for cache, rows in ((kc8, key32), (vc8, value32)):
            want = torch.zeros(1024, 2, 32, dtype=f8)
            want[slots] = to_cache_dtype(rows, f8)
            assert torch.equal(cache.view(torch.uint8).view(1024, 2, 32), want.view(torch.uint8))
    if f8 == torch.float8_e4m3fn:  # saturation, not NaN: the largest code, 448, for every large value
        big = torch.tensor([448.0, 449.0, 464.0, 1e4, float("inf")]).repeat_interleave(2)
        big[1::2] *= -1
        rows = torch.cat([big, torch.zeros(54)]).view(1, 2, 32)
        CpuAttention().write_kv(rows, rows, kc8, vc8, slots[:1])
        codes = kc8.view(torch.uint8).view(1024, 2, 32)[slots[0]].flatten()[:10]
        assert codes.tolist() == [0x7E, 0xFE] * 5

    heads, kvh, dim, rows, cached, max_pos = 9, 3, 64, 70, 61, 512
    cos_t, sin_t = _rope_tables(dim, max_pos)
    positions = torch.randint(0, max_pos, (rows,), generator=g)
    slots = torch.randperm(40 * 16, generator=g)[:cached]
    for dtype in (torch.bfloat16, torch.float32):
        qkv = (4 * torch.randn(rows, (heads + 2 * kvh) * dim, generator=g)).to(dtype)
        rope = cpu.rope_inputs(positions, cos_t, sin_t, dtype)
        kc, vc = (torch.randn(40, 16, kvh, dim, generator=g).to(dtype) for _ in range(2))
        kc8, vc8 = kc.to(f8), vc.to(f8)
        q8 = cpu.rotary_qkv_to_cache(qkv, rope, heads, kc8, vc8, slots)
        q = cpu.rotary_qkv_to_cache(qkv, rope, heads, kc, vc, slots)
        assert q8 is not None and torch.equal(q8, q)
        assert torch.equal(kc8.view(torch.uint8), to_cache_dtype(kc, f8).view(torch.uint8))
        assert torch.equal(vc8.view(torch.uint8), to_cache_dtype(vc, f8).view(torch.uint8))
    with pytest.raises(RuntimeError, match=r"or one-byte caches"):
        torch.ops.pagoda_cpu.rotary_qkv_to_cache(qkv.half(), positions, cos_t, sin_t, q.half(), kc8, vc8, slots)
    with pytest.raises(RuntimeError, match=r"or be bf16 or float32 for one-byte caches"):
        rows16 = torch.zeros(4, kvh, dim).half()
        torch.ops.pagoda_cpu.reshape_and_cache(rows16, rows16, kc8, vc8, slots[:4])


def test_rotary_qkv_to_cache_rejects_bad_slots_and_shapes(ops):
    cpu, _ = ops
    cos_t, sin_t = _rope_tables(8, 16)
    qkv = torch.randn(2, 3 * 8)
    rope = cpu.rope_inputs(torch.tensor([0, 1]), cos_t, sin_t, torch.float32)
    kc, vc = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.rotary_qkv_to_cache(qkv, rope, 1, kc, vc, torch.tensor([0, 8]))
    with pytest.raises(RuntimeError, match="slot_mapping must be int64"):
        cpu.rotary_qkv_to_cache(qkv, rope, 1, kc, vc, torch.tensor([0, 1, 2]))
    with pytest.raises(RuntimeError, match="qkv must be"):
        cpu.rotary_qkv_to_cache(qkv, rope, 2, kc, vc, torch.tensor([0, 1]))
    assert not kc.any() and not vc.any()  # nothing written before the checks


def test_rotary_rejects_positions_outside_the_table(ops):
    cpu, _ = ops
    x = torch.randn(2, 1, 8)
    cos_t = sin_t = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu.rotary(x, cpu.rope_inputs(torch.tensor([0, 4]), cos_t, sin_t, torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 1544), (300, 1536)])
def test_silu_and_mul_matches_torch_exactly(ops, dtype, rows, inter):
    cpu, ref = ops
    g = torch.Generator().manual_seed(rows + inter)
    # A strided gate_up (rows of a wider buffer), with the values that test exp's edges.
    buf = (4 * torch.randn(rows, 2 * inter + 16, generator=g)).to(dtype)
    gate_up = buf[:, 8:8 + 2 * inter]
    edge = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 100.0, -100.0, 1e-30, -88.5, 88.7])
    gate_up[0, :10] = edge.to(dtype)
    out = cpu.silu_and_mul(gate_up)
    want = ref.silu_and_mul(gate_up)
    assert out.shape == (rows, inter) and out.dtype == dtype and out.is_contiguous()
    same = (out == want) | (out.isnan() & want.isnan())
    assert bool(same.all()), f"{int((~same).sum())} elements differ"


def test_silu_and_mul_bf16_is_bit_exact_for_every_gate_value(ops):
    """All 65536 bf16 gate values (NaNs, infinities, zeros of both signs, denormals included), times
    random up values and times one: the result's bits equal torch's F.silu(gate) * up (NaN for NaN). The bf16 kernel
    looks silu up in a table it builds from its own replica of torch's arithmetic, so this is what
    proves every entry of that table is torch's result."""
    cpu, ref = ops
    inter = 2048
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(-1, inter)
    for up in (torch.randn(gate.shape, generator=torch.Generator().manual_seed(5)).bfloat16(),
               torch.ones_like(gate)):
        gate_up = torch.cat([gate, up], dim=1)
        got, want = cpu.silu_and_mul(gate_up), ref.silu_and_mul(gate_up)
        # NaN where torch has NaN (torch's vector and scalar conversions write different NaN bits),
        # the same bits everywhere else (zeros' signs included).
        assert bool((got.isnan() == want.isnan()).all())
        finite = ~want.isnan()
        same = got.view(torch.int16)[finite] == want.view(torch.int16)[finite]
        assert bool(same.all()), f"{int((~same).sum())} of {int(finite.sum())} differ"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 16), (5, 17), (64, 49152), (300, 1000)])
def test_argmax_matches_torch_max_indices(ops, dtype, rows, vocab):
    """Greedy sampling's argmax: the first maximum of each row, ties, -inf rows and NaNs included, on
    strided rows (a vocabulary slice of padded logits) and across the multi-thread threshold."""
    cpu, ref = ops
    g = torch.Generator().manual_seed(rows * vocab)
    padded = torch.randn(rows, vocab + 5, generator=g).to(dtype)
    # few distinct values, so rows have ties for the maximum at several places
    padded = (padded * 2).round() if rows % 2 else padded
    logits = padded[:, :vocab]
    logits[0] = float("-inf")
    if rows > 2:
        logits[1, vocab // 2] = float("nan")
        logits[1, vocab - 1] = float("nan")
        logits[2, -1] = float("inf")  # the maximum in the scalar tail
    got = cpu.argmax(logits)
    want = logits.max(-1).indices
    assert got.dtype == torch.long and got.shape == (rows,)
    assert torch.equal(got, want), (got[got != want][:5], want[got != want][:5])
    assert torch.equal(ref.argmax(logits), want)


# ---- Random sampling in one pass a row (CpuLayerOps.sample) --------------------------------------

def _kept_distribution(row: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float):
    """float64 reference of the sampler's filters on one row (engine_service/sampler.py's order:
    min_p, top_k with ties kept, then the smallest top set with mass >= top_p, ties kept): the kept
    tokens' probabilities (zero elsewhere), and each token's distance from the top_p edge."""
    z = row.double() / temperature
    p = z.softmax(-1)
    keep = p >= min_p * p.max()
    if top_k:
        kth = z[keep].topk(min(top_k, int(keep.sum()))).values[-1]
        keep &= z >= kth
    q = torch.where(keep, p, torch.zeros_like(p))
    q = q / q.sum()
    edge = torch.full_like(q, float("inf"))
    if top_p < 1.0:
        order = q.argsort(descending=True)
        sq = q[order]
        # mass strictly above each value (ties share it): cumulative mass before the first of its run
        before = torch.cumsum(sq, 0) - sq
        first = torch.searchsorted(-sq, -sq, side="left")  # descending: the first index of each run
        above = torch.empty_like(q)
        above[order] = before[first]
        keep &= above < top_p
        edge = (above - top_p).abs()
        q = torch.where(keep, q, torch.zeros_like(q))
        q = q / q.sum()
    return q, edge


SAMPLE_CASES = [  # temperature, top_k, top_p, min_p
    (1.0, 0, 1.0, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.3, 50, 1.0, 0.0),
    (1.0, 40, 0.8, 0.0),
    (0.9, 0, 0.95, 0.05),
    (2.0, 3000, 0.5, 0.0),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [49152, 49157])  # 49157: a tail after the vector loops and the last block
@pytest.mark.parametrize("case", SAMPLE_CASES, ids=lambda c: "T{}-k{}-p{}-minp{}".format(*c))
def test_sample_inverts_the_kept_tokens_cumulative_mass(ops, dtype, vocab, case):
    """At the model's vocabulary size, on uniforms spread over [0, 1): each token is the one whose
    span of the kept tokens' cumulative mass (in index order) holds the uniform, against a float64
    reference of the filters, so the kernel keeps exactly the reference's tokens and draws from
    their renormalised probabilities; greedy rows beside them take the argmax."""
    cpu, _ = ops
    temperature, top_k, top_p, min_p = case
    g = torch.Generator().manual_seed(vocab + int(100 * top_p) + top_k)
    row = (torch.randn(vocab, generator=g) * 2).to(dtype)
    row[[10, 300, vocab - 1]] = row.max() + 1  # a three-way tie for the top, across blocks
    q, edge = _kept_distribution(row, temperature, top_k, top_p, min_p)
    assert edge.min() > 1e-6, "a token sits on the top_p edge: the float rounding decides it"
    n = 1024
    uniform = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    logits = row.unsqueeze(0).expand(n + 1, -1)  # one row in memory (row stride 0), n + 1 draws
    params = [torch.full((n + 1,), v, dtype=t) for v, t in
              ((temperature, torch.float32), (top_k, torch.long), (top_p, torch.float32), (min_p, torch.float32))]
    params[0][-1] = 0.0  # the last row is greedy
    got = cpu.sample(logits, *params, torch.cat([uniform, torch.zeros(1, dtype=torch.float64)]))
    assert got[-1] == row.float().argmax()
    tokens = got[:n]
    assert (q[tokens] > 0).all(), "sampled a token the filters drop"
    cum = torch.cumsum(q, 0)
    lo, hi = cum[tokens] - q[tokens], cum[tokens]
    tol = 1e-5
    assert ((lo - tol <= uniform) & (uniform <= hi + tol)).all()
    kept = int((q > 0).sum())
    if kept <= 64:  # few kept tokens: the grid reaches each one in proportion to its mass
        counts = torch.bincount(tokens, minlength=vocab).double()
        assert ((counts - q * n).abs() <= 2).all()


def test_sample_keeps_ties_at_the_top_k_and_top_p_edges(ops):
    """Tied logits at a filter's edge are all kept, as the sampler's torch path keeps them: top_k=1
    and a tiny top_p on a three-way tie for the maximum draw each of the three a third of the time."""
    cpu, _ = ops
    vocab, n = 49152, 999
    row = torch.full((vocab,), -5.0)
    row[[7, 20000, 49151]] = 3.0
    row[[8, 9]] = 2.9
    uniform = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    logits = row.unsqueeze(0).expand(n, -1)
    for top_k, top_p in ((1, 1.0), (0, 1e-9), (2, 0.5)):
        got = cpu.sample(logits, torch.ones(n), torch.full((n,), top_k), torch.full((n,), top_p), torch.zeros(n),
                         uniform)
        assert torch.bincount(got, minlength=vocab)[[7, 20000, 49151]].tolist() == [333, 333, 333]


def test_sample_top_k_tells_apart_probabilities_one_float_step_apart(ops):
    """Ten tokens whose unnormalised probabilities are the ten floats just below 1.0 (logits
    -j 2^-24: exp rounds them to 1 - j 2^-24) at shuffled places: top_k keeps exactly its k, so the
    selection resolves the last bit of a float."""
    cpu, _ = ops
    vocab, n = 24, 200
    g = torch.Generator().manual_seed(11)
    places = torch.randperm(vocab, generator=g)[:10]
    row = torch.full((vocab,), float("-inf"))
    row[places] = -torch.arange(10, dtype=torch.float32) * 2.0 ** -24
    uniform = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for k in range(1, 10):
        got = cpu.sample(row.unsqueeze(0).expand(n, -1), torch.ones(n), torch.full((n,), k), torch.ones(n),
                         torch.zeros(n), uniform)
        assert set(got.tolist()) == set(places[:k].tolist()), k


def test_sample_top_k_where_exactly_k_tokens_pass_its_first_cut(ops):
    """top_k gathers its candidates above the first of a few powers of two that at least k pass:
    with exactly k there (every other token a hair below 2^-8 of the maximum's probability), the
    k are kept and the rest are not."""
    cpu, _ = ops
    vocab, n, k = 4096, 256, 6
    row = torch.full((vocab,), math.log(2.0 ** -8) - 1e-3)
    places = torch.tensor([3, 700, 701, 2000, 3999, 4095])
    row[places] = torch.tensor([0.0, -1.0, -2.0, -3.0, -4.0, -5.0])
    uniform = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    got = cpu.sample(row.unsqueeze(0).expand(n, -1), torch.ones(n), torch.full((n,), k), torch.ones(n),
                     torch.zeros(n), uniform)
    assert set(got.tolist()) == set(places.tolist())


def test_sample_flat_rows_take_every_radix_level(ops):
    """Nearly equal logits (the kernel's unnormalised probabilities all in [0.61, 1]: a few buckets
    of their top bits), so the top_p edge is found in the selection's last levels. The logits are
    1e-5 apart, so that float32 holds no ties the float64 reference does not."""
    cpu, _ = ops
    vocab, n = 49157, 2048
    g = torch.Generator().manual_seed(5)
    row = torch.randperm(vocab, generator=g).float() * 1e-5
    q, edge = _kept_distribution(row, 1.0, 0, 0.5, 0.0)
    assert edge.min() > 1e-7
    uniform = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    got = cpu.sample(row.unsqueeze(0).expand(n, -1), torch.ones(n), torch.zeros(n, dtype=torch.long),
                     torch.full((n,), 0.5), torch.zeros(n), uniform)
    assert (q[got] > 0).all()
    cum = torch.cumsum(q, 0)
    assert ((cum[got] - q[got] - 1e-5 <= uniform) & (uniform <= cum[got] + 1e-5)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sample_applies_penalties_and_the_ban_to_a_copy_of_the_row(ops, dtype):
    """Penalties (repetition over prompt and output, frequency and presence over the output, ids
    repeated and out of range) and a min_tokens ban, as the sampler's torch path applies them, float
    op for float op: a greedy row takes exactly the argmax of the penalised logits, sampled rows
    invert the penalised distribution, rows without penalties beside them are untouched, and the
    logits handed in are left as they were."""
    cpu, _ = ops
    vocab, n = 49157, 512
    g = torch.Generator().manual_seed(3)
    row = (torch.randn(vocab, generator=g) * 2).to(dtype)
    prompt = torch.randint(0, vocab, (300,), generator=g).tolist() + [5, 5, -1, vocab + 3]
    output = torch.randint(0, vocab, (60,), generator=g).tolist() + [int(row.float().argmax())] * 3 + [7, 7, 7, 7]
    banned = [int(row.float().topk(2).indices[1]), 11, vocab + 1]
    rep, freq, pres = 1.3, 0.4, 0.25
    ref = row.float().clone()  # the torch path's arithmetic (engine_service/sampler.py _apply_penalties)
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[[t for t in prompt + output if 0 <= t < vocab]] = True
    ref = torch.where(seen, torch.where(ref > 0, ref / rep, ref * rep), ref)
    counts = torch.bincount(torch.tensor(output), minlength=vocab).float()
    ref = ref - freq * counts - pres * (counts > 0)
    ref[[t for t in banned if t < vocab]] = float("-inf")

    def flat(lists):
        starts = torch.tensor([0] + [len(x) for x in lists]).cumsum(0)
        return torch.tensor([t for x in lists for t in x], dtype=torch.long), starts

    rows = n + 2  # n sampled, one greedy, one without penalties
    logits = row.unsqueeze(0).expand(rows, -1)
    before = row.clone()
    penalties = torch.tensor([[rep, freq, pres]] * (n + 1) + [[1.0, 0.0, 0.0]])
    temperature = torch.full((rows,), 0.8)
    temperature[n] = 0.0
    uniform = torch.cat([(torch.arange(n, dtype=torch.float64) + 0.5) / n, torch.zeros(1, dtype=torch.float64),
                         torch.tensor([0.999999], dtype=torch.float64)])
    got = cpu.sample(logits, temperature, torch.zeros(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows),
                     uniform, penalties, flat([prompt] * (n + 1) + [[]]), flat([output] * (n + 1) + [[]]),
                     flat([banned] * (n + 1) + [[]]))
    assert torch.equal(row, before)
    assert got[n] == ref.argmax()
    q = (ref.double() / 0.8).softmax(-1)
    cum = torch.cumsum(q, 0)
    tokens = got[:n]
    assert (q[tokens] > 0).all()
    assert ((cum[tokens] - q[tokens] - 1e-5 <= uniform[:n]) & (uniform[:n] <= cum[tokens] + 1e-5)).all()
    plain = (row.double() / 0.8).softmax(-1)  # the last row: no penalties, no ban
    assert plain.cumsum(0)[got[-1]] >= 0.999999 - 1e-5


def test_sample_rejects_bad_arguments_naming_them(ops):
    cpu, _ = ops
    n = 3
    good = dict(temperature=torch.ones(n), top_k=torch.zeros(n, dtype=torch.long), top_p=torch.ones(n),
                min_p=torch.zeros(n), uniform=torch.full((n,), 0.5, dtype=torch.float64))
    logits = torch.randn(n, 40)
    ids = (torch.tensor([1, 2], dtype=torch.long), torch.tensor([0, 1, 1, 2]))
    for name, bad, message in [
        ("temperature", torch.ones(n, dtype=torch.float64), "temperature must be a contiguous Float"),
        ("top_k", torch.zeros(n + 1, dtype=torch.long), r"top_k must be a contiguous Long \[3\]"),
        ("uniform", torch.full((n,), 0.5), "uniform must be a contiguous Double"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            cpu.sample(logits, **{**good, name: bad})
    with pytest.raises(RuntimeError, match=r"penalties must be a contiguous float32 \[N, 3\]"):
        cpu.sample(logits, **good, penalties=torch.ones(n, 2), output=ids)
    with pytest.raises(RuntimeError, match="output starts must run from 0 to 2"):
        cpu.sample(logits, **good, penalties=torch.ones(n, 3), output=(ids[0], torch.tensor([0, 1, 1, 3])))
    with pytest.raises(RuntimeError, match="output starts must not decrease"):
        cpu.sample(logits, **good, penalties=torch.ones(n, 3), output=(ids[0], torch.tensor([0, 2, 1, 2])))
    with pytest.raises(RuntimeError, match="prompt / output ids need penalties"):
        cpu.sample(logits, **good, output=ids)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        cpu.sample(logits.half(), **good)
    assert cpu.sample(logits, **good).shape == (n,)  # and the same call with good arguments works


def test_sample_rows_without_a_finite_maximum_take_the_argmax(ops):
    cpu, _ = ops
    logits = torch.randn(3, 40)
    logits[0] = float("-inf")
    logits[1, 5] = float("nan")
    logits[2, 9] = float("inf")
    got = cpu.sample(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3), torch.zeros(3),
                     torch.full((3,), 0.5, dtype=torch.float64))
    assert got.tolist() == [0, 5, 9]

# ---- Logprobs in two passes a row (CpuLayerOps.logprobs) -----------------------------------------

def _top_k_reference(x: torch.Tensor, k: int):
    """The k largest of each row, largest first, equal values by lower index, NaN lowest."""
    key = x.double().nan_to_num(nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    order = torch.sort(-key, dim=-1, stable=True).indices[:, :k]
    return order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,vocab", [(1, 7), (3, 16), (5, 17), (64, 49152), (300, 1000)])
@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_are_log_softmax_at_the_tokens_and_its_top_k(ops, dtype, rows, vocab, k):
    """Against a float64 log_softmax of the same values: the tokens' logprobs and the top k's, on
    strided rows (a vocabulary slice of padded logits), rows with ties for the top places (the lower
    index first), the top k in the scalar tail, -inf entries, and k up to the whole row."""
    cpu, ref = ops
    k = min(k, vocab)
    g = torch.Generator().manual_seed(rows * vocab + k)
    padded = (torch.randn(rows, vocab + 5, generator=g) * 3).to(dtype)
    if rows % 2:  # few distinct values: ties for the top places
        padded = padded.round()
    logits = padded[:, :vocab]
    logits[0, vocab // 3] = float("-inf")
    if rows > 2:
        logits[2, -1] = logits[2].float().max() + 1  # the maximum in the scalar tail
    tokens = torch.randint(0, vocab, (rows,), generator=g)
    token_lp, rank, top_ids, top_lp = cpu.logprobs(logits, tokens, k)
    want = logits.double().log_softmax(-1)
    assert token_lp.dtype == torch.float32 and top_lp.dtype == torch.float32 and top_ids.dtype == torch.long
    assert top_ids.shape == (rows, k) and top_lp.shape == (rows, k)
    torch.testing.assert_close(token_lp.double(), want.gather(1, tokens.unsqueeze(1)).squeeze(1), atol=2e-5, rtol=1e-5)
    x = logits.double()
    assert rank.dtype == torch.long and torch.equal(rank, (x > x.gather(1, tokens.unsqueeze(1))).sum(-1) + 1)
    assert torch.equal(top_ids, _top_k_reference(logits, k))
    torch.testing.assert_close(top_lp.double(), want.gather(1, top_ids), atol=2e-5, rtol=1e-5)
    # the torch path gives the same values (its order of equal values is its own)
    t_lp, t_rank, _, t_top = ref.logprobs(logits, tokens, k)
    assert torch.equal(rank, t_rank)
    torch.testing.assert_close(token_lp, t_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(top_lp, t_top, atol=2e-5, rtol=1e-5)


def test_logprobs_of_rows_with_nan_or_no_finite_value(ops):
    """A NaN makes its row's logprobs NaN (as log_softmax's) and ranks lowest in the top k; a row of
    -inf has NaN logprobs (log_softmax's too); the other rows are unaffected."""
    cpu, _ = ops
    logits = torch.randn(4, 40)
    logits[0, 3] = float("nan")
    logits[1] = float("-inf")
    logits[2, :38] = float("nan")
    tokens = torch.tensor([0, 1, 2, 3])
    token_lp, _, top_ids, top_lp = cpu.logprobs(logits, tokens, 3)
    assert token_lp[:3].isnan().all() and top_lp[:3].isnan().all()
    assert 3 not in top_ids[0].tolist()
    assert top_ids[2].tolist()[:2] == sorted([38, 39], key=lambda i: -float(logits[2, i]))
    want = logits[3].log_softmax(-1)
    torch.testing.assert_close(token_lp[3], want[3])
    assert torch.equal(top_ids[3], want.topk(3).indices)


def test_logprobs_reject_bad_arguments_naming_them(ops):
    cpu, _ = ops
    logits = torch.randn(3, 40)
    op = torch.ops.pagoda_cpu.logprobs_rows
    for tokens, message in [(torch.tensor([0, 40, 1]), r"tokens\[1\] is 40, outside \[0, 40\)"),
                            (torch.tensor([0, -1, 1]), r"tokens\[1\] is -1"),
                            (torch.tensor([0, 1]), r"tokens must be a contiguous int64 \[3\]")]:
        with pytest.raises(RuntimeError, match=message):
            cpu.logprobs(logits, tokens, 2)
    tokens = torch.tensor([0, 1, 2])
    with pytest.raises(RuntimeError, match=r"topk_ids must be a contiguous int64 \[3, K\] with K <= 40"):
        op(logits, tokens, torch.empty(3), torch.empty(3, dtype=torch.long), torch.empty(3, 41, dtype=torch.long),
           torch.empty(3, 41))
    with pytest.raises(RuntimeError, match=r"topk_lp must be a contiguous float32 \[3, 2\]"):
        op(logits, tokens, torch.empty(3), torch.empty(3, dtype=torch.long), torch.empty(3, 2, dtype=torch.long),
           torch.empty(3, 3))
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        op(logits.half(), tokens, torch.empty(3), torch.empty(3, dtype=torch.long), torch.empty(3, 2, dtype=torch.long),
           torch.empty(3, 2))
    with pytest.raises(RuntimeError, match=r"token_rank must be a contiguous int64 \[3\]"):
        op(logits, tokens, torch.empty(3), torch.empty(3), torch.empty(3, 2, dtype=torch.long), torch.empty(3, 2))
    assert cpu.logprobs(logits, tokens, 2)[2].shape == (3, 2)  # and good arguments work


# ---- Pagoda's GEMMs: bf16 (CPUs with AVX512-BF16 or AMX-BF16), float32 (CPUs with AVX2 and FMA) --

def test_gemms_run_where_the_cpu_has_their_instructions(ops):
    """Pagoda's bf16 GEMMs are on wherever the CPU has AVX512-BF16 (AMX CPUs have it too), its float32
    GEMMs wherever it has AVX2 and FMA, so their tests below run there rather than skip; with AMX
    tiles plain bf16 GEMMs over AMX_GEMM_MAX_ROWS rows go to oneDNN, with the dot-product kernel
    none do. The engine prefers the float32 GEMM to oneDNN's wherever it runs."""
    from pagoda_kernels.layer_ops import AMX_GEMM_MAX_ROWS

    cpu, _ = ops
    flags = build_cpu_flags()
    assert cpu.bf16_gemm == ("avx512_bf16" in flags)
    if cpu.bf16_gemm:
        amx = "amx_bf16" in flags and "amx_tile" in flags
        assert cpu.gemm_max_rows == (AMX_GEMM_MAX_ROWS if amx else None)
    assert cpu.f32_gemm == ("avx2" in flags and "fma" in flags)
    assert cpu.f32_gemm_preferred == cpu.f32_gemm


GEMM_DTYPES = [torch.bfloat16, torch.float32]
# (activations, weights): bf16 on bf16 weights, float32 on float32, and bf16 on float32 weights (a
# bf16 model on a CPU without bf16 dot products: x widened, the output rounded to bf16).
GEMM_FORMS = [pytest.param(torch.bfloat16, torch.bfloat16, id="bf16"),
              pytest.param(torch.float32, torch.float32, id="fp32"),
              pytest.param(torch.bfloat16, torch.float32, id="bf16-on-fp32")]


def _gemm_ops(ops, dtype=torch.bfloat16):
    cpu, _ = ops
    if dtype == torch.bfloat16 and not cpu.bf16_gemm:
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX-BF16 (the engine uses oneDNN's GEMMs here)")
    if dtype == torch.float32 and not cpu.f32_gemm:
        pytest.skip("this CPU has no AVX2 and FMA (the engine uses oneDNN's GEMMs here)")
    return cpu


@pytest.mark.parametrize("n,k,dtype,w_dtype", [
    pytest.param(n, k, *form.values, id=f"{n}x{k}-{form.id}") for n, k in [(960, 576), (576, 1536), (128, 64), (64, 7)]
    for form in GEMM_FORMS if k % 2 == 0 or form.values[1] == torch.float32])  # bf16 weights: k even
def test_gemm_linear_is_close_to_float64_and_row_count_invariant(ops, n, k, dtype, w_dtype):
    """Each row an fp32 accumulation (rounded once in bf16), and the same bits whether the call has
    1, 40 or 600 rows (more than one 256-row slice)."""
    cpu = _gemm_ops(ops, w_dtype)
    g = torch.Generator().manual_seed(n + k)
    w = (0.05 * torch.randn(n, k, generator=g)).to(w_dtype)
    packed = cpu.gemm_pack(w)
    x = torch.randn(600, k, generator=g).to(dtype)
    full = cpu.gemm_linear(x, packed)
    assert full.shape == (600, n) and full.dtype == dtype
    if w_dtype != dtype:  # bf16 x on float32 weights: the float32 GEMM of x widened, rounded once
        assert torch.equal(full, cpu.gemm_linear(x.float(), packed).to(dtype))
    want = x.double() @ w.double().T
    if dtype == torch.bfloat16:
        assert ((full.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-2).all()
    else:  # fp32 sums: k roundings of at most 2^-24 of a partial sum each
        assert ((full.double() - want).abs() <= k * 2 ** -24 * (x.double().abs() @ w.double().abs().T)).all()
    for rows in (*range(1, 13), 40, 257):  # 1-12: every remainder of the kernels' row groups
        assert torch.equal(cpu.gemm_linear(x[-rows:].contiguous(), packed), full[-rows:])
    if w_dtype == torch.float32:  # a row of a strided x, as the layers hand over views
        wide = torch.randn(600, k + 5, generator=g).to(dtype)
        wide[:, :k] = x
        assert torch.equal(cpu.gemm_linear(wide[:, :k], packed), full)


@pytest.mark.parametrize("dtype,w_dtype", GEMM_FORMS)
def test_gemm_non_temporal_weight_reads_change_no_bits(ops, dtype, w_dtype):
    """Calls of up to 6 rows (by default) read the weights non-temporally, on the dot-product kernel
    and the float32 one; the products are the same with them on or off, at every row count around
    the limit, the argmax epilogue included."""
    cpu = _gemm_ops(ops, w_dtype)
    set_nta = torch.ops.pagoda_cpu.gemm_set_nta_rows
    g = torch.Generator().manual_seed(6)
    w = (0.05 * torch.randn(960, 576, generator=g)).to(w_dtype)
    packed = cpu.gemm_pack(w)
    x = torch.randn(9, 576, generator=g).to(dtype)
    assert set_nta(6) == 6, "the default: calls of up to 6 rows"
    try:
        for rows in range(1, 10):
            xr = x[:rows].contiguous()
            on = cpu.gemm_linear(xr, packed), cpu.gemm_linear_argmax(xr, packed, 960)
            assert set_nta(0) == 6
            off = cpu.gemm_linear(xr, packed), cpu.gemm_linear_argmax(xr, packed, 960)
            assert set_nta(6) == 0
            assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1]), f"{rows} rows"
            assert torch.equal(on[1], on[0].argmax(-1))
    finally:
        set_nta(6)
    for bad in (-1, 7):
        with pytest.raises(RuntimeError, match=r"rows must be in \[0, 6\]"):
            set_nta(bad)
    assert set_nta(6) == 6, "a refused setting changes nothing"


@pytest.mark.parametrize("dtype,w_dtype", GEMM_FORMS)
@pytest.mark.parametrize("rows", [1, 40, 300])
def test_gemm_linear_silu_mul_is_the_gemm_then_silu_and_mul(ops, rows, dtype, w_dtype):
    from pagoda_kernels.layer_ops import interleave_gate_up

    cpu = _gemm_ops(ops, w_dtype)
    g = torch.Generator().manual_seed(rows)
    inter, k = 256, 576
    w = (0.05 * torch.randn(2 * inter, k, generator=g)).to(w_dtype)
    x = (3 * torch.randn(rows, k, generator=g)).to(dtype)
    got = cpu.gemm_linear_silu_mul(x, cpu.gemm_pack(interleave_gate_up(w)))
    want = cpu.silu_and_mul(cpu.gemm_linear(x, cpu.gemm_pack(w)))
    assert got.shape == (rows, inter) and got.dtype == dtype and torch.equal(got, want)


@pytest.mark.parametrize("dtype,w_dtype", GEMM_FORMS)
@pytest.mark.parametrize("rows,cached", [(8, 8), (300, 293)])
def test_gemm_linear_rotary_qkv_to_cache_is_the_gemm_then_rotary_qkv_to_cache(ops, rows, cached, dtype, w_dtype):
    """Bitwise the unfused pair: rotary(q) for every row, rotary(k) and v in their slots for the
    first `cached` rows (the rest are GEMM padding), every other slot untouched."""
    cpu = _gemm_ops(ops, w_dtype)
    g = torch.Generator().manual_seed(rows)
    heads, kvh, dim, k, max_pos, blocks, bs = 9, 3, 64, 576, 512, 40, 16
    cos_t, sin_t = _rope_tables(dim, max_pos)
    w = (0.05 * torch.randn((heads + 2 * kvh) * dim, k, generator=g)).to(w_dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    positions = torch.randint(0, max_pos, (rows,), generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:cached]
    rope = cpu.rope_inputs(positions, cos_t, sin_t, dtype)
    caches = [torch.randn(blocks, bs, kvh, dim, generator=g).to(dtype) for _ in range(2)]
    kc, vc, kc_ref, vc_ref = caches[0].clone(), caches[1].clone(), caches[0].clone(), caches[1].clone()
    q = cpu.gemm_linear_rotary_qkv_to_cache(x, cpu.gemm_pack(w), rope, heads, kc, vc, slots)
    q_ref = cpu.rotary_qkv_to_cache(cpu.gemm_linear(x, cpu.gemm_pack(w)), rope, heads, kc_ref, vc_ref, slots)
    assert q.shape == (rows, heads, dim) and q.dtype == dtype and torch.equal(q, q_ref)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref) and not torch.equal(kc, caches[0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu.gemm_linear_rotary_qkv_to_cache(x, cpu.gemm_pack(w), rope, heads, kc, vc,
                                           torch.full((cached,), blocks * bs))
    for f8 in (torch.float8_e5m2, torch.float8_e4m3fn) if dtype in (torch.bfloat16, torch.float32) else ():
        # a one-byte cache: those rows as torch converts them
        kc8, vc8 = caches[0].to(f8), caches[1].to(f8)
        q8 = cpu.gemm_linear_rotary_qkv_to_cache(x, cpu.gemm_pack(w), rope, heads, kc8, vc8, slots)
        assert torch.equal(q8, q_ref)
        assert torch.equal(kc8.view(torch.uint8), to_cache_dtype(kc_ref, f8).view(torch.uint8))
        assert torch.equal(vc8.view(torch.uint8), to_cache_dtype(vc_ref, f8).view(torch.uint8))


@pytest.mark.parametrize("dtype,w_dtype,float32_kernel", [
    *(pytest.param(*form.values, False, id=form.id) for form in GEMM_FORMS),
    pytest.param(torch.bfloat16, torch.bfloat16, True, id="bf16-on-the-float32-kernel")])
def test_gemm_linear_argmax_is_the_argmax_of_gemm_linear(ops, dtype, w_dtype, float32_kernel):
    """Greedy sampling inside the LM head's GEMM: the index argmax() finds on gemm_linear's output,
    ties (duplicated weight rows: the first column wins, also across blocks and threads), NaN
    (the first NaN wins), columns past ``valid`` ignored, at any row count."""
    cpu = _gemm_ops(ops, torch.float32 if float32_kernel else w_dtype)
    g = torch.Generator().manual_seed(11)
    n, k = 1024, 576
    w = (0.05 * torch.randn(n, k, generator=g)).to(w_dtype)
    w[700] = w[3]  # the same logit at columns 3 and 700 (different blocks): 3 wins where it is the max
    w[5] = w[4]  # and at 4 and 5 (one block)
    x = (3 * torch.randn(300, k, generator=g)).to(dtype)
    x[10] = w[3].to(dtype) * 50  # row 10's maximum at 3 (and 700)
    x[11] = w[4].to(dtype) * 50  # row 11's at 4 (and 5)
    packed = cpu.gemm_pack(w, float32_kernel=float32_kernel)
    logits = cpu.gemm_linear(x, packed)
    for valid in (n, 1000, 650, 1):
        want = cpu.argmax(logits[:, :valid].contiguous())
        assert torch.equal(want, logits[:, :valid].float().max(-1).indices)
        for rows in (300, 257, 40, 7, 1):
            got = cpu.gemm_linear_argmax(x[-rows:].contiguous(), packed, valid)
            assert got.dtype == torch.long and torch.equal(got, want[-rows:])
    assert cpu.gemm_linear_argmax(x[10:12].contiguous(), packed, n).tolist() == [3, 4]
    nan_w = w.clone()
    nan_w[600] = float("nan")  # column 600 is NaN in every row: every row's argmax
    nan_w[900] = float("nan")
    got = cpu.gemm_linear_argmax(x, cpu.gemm_pack(nan_w, float32_kernel=float32_kernel), n)
    assert got.tolist() == [600] * 300
    for bad in (0, n + 1):
        with pytest.raises(RuntimeError, match="valid must be in"):
            cpu.gemm_linear_argmax(x, packed, bad)


@pytest.mark.parametrize("dtype,w_dtype,float32_kernel", [
    *(pytest.param(*form.values, False, id=form.id) for form in GEMM_FORMS),
    pytest.param(torch.bfloat16, torch.bfloat16, True, id="bf16-on-the-float32-kernel")])
def test_gemm_linear_logprobs_are_the_logprobs_of_gemm_linear(ops, dtype, w_dtype, float32_kernel):
    """Prompt scoring inside the LM head's GEMM: each row's token's logprob and rank and its top k
    as ``logprobs`` gives them on gemm_linear's output (ids and ranks exactly, ties by lower id
    across blocks and threads; logprobs up to the exp-sum's order), columns past ``valid``
    ignored, at any row count and the same bits whatever the row count; NaN rows NaN."""
    cpu = _gemm_ops(ops, torch.float32 if float32_kernel else w_dtype)
    g = torch.Generator().manual_seed(12)
    n, hidden = 1024, 576
    w = (0.05 * torch.randn(n, hidden, generator=g)).to(w_dtype)
    w[700] = w[3]  # the same logit at columns 3 and 700 (different blocks)
    w[5] = w[4]  # and at 4 and 5 (one block)
    x = (3 * torch.randn(300, hidden, generator=g)).to(dtype)
    x[10] = w[3].to(dtype) * 50  # row 10's maximum at 3 and 700
    x[11] = w[4].to(dtype) * 50  # row 11's at 4 and 5
    packed = cpu.gemm_pack(w, float32_kernel=float32_kernel)
    logits = cpu.gemm_linear(x, packed)
    tokens = torch.randint(0, 650, (300,), generator=g)
    tokens[10], tokens[11] = 700, 5  # tied with the maximum: rank 2 (one logit, 3 / 4, is equal, not above)
    for valid, k in ((n, 20), (1000, 3), (650, 1), (650, 0), (64, 2)):
        t = tokens.clamp(max=valid - 1)
        lp, rank, ids, top = cpu.logprobs(logits[:, :valid].contiguous(), t, k)
        every = None
        for rows in (300, 257, 40, 7, 1):
            got = cpu.gemm_linear_logprobs(x[-rows:].contiguous(), packed, valid, t[-rows:], k)
            assert torch.equal(got[1], rank[-rows:]) and torch.equal(got[2], ids[-rows:]), (valid, k, rows)
            torch.testing.assert_close(got[0], lp[-rows:], rtol=0, atol=2e-5)
            torch.testing.assert_close(got[3], top[-rows:], rtol=0, atol=2e-5)
            every = got if every is None else every
            assert all(torch.equal(a[-rows:], b) for a, b in zip(every, got)), "depends on the row count"
        if valid == n:
            assert ids[10, :2].tolist() == [3, 700] and ids[11, :2].tolist() == [4, 5]
            assert rank[10] == 1 and rank[11] == 1  # no logit above the token's: rank 1 (vLLM's)
    nan_w = w.clone()
    nan_w[600] = float("nan")
    lp, rank, ids, top = cpu.gemm_linear_logprobs(x[:5].contiguous(), cpu.gemm_pack(nan_w, float32_kernel=float32_kernel),
                                                  n, tokens[:5], 2)
    assert lp.isnan().all() and top.isnan().all() and 600 not in ids
    for bad in (0, n + 1):
        with pytest.raises(RuntimeError, match="valid must be in"):
            cpu.gemm_linear_logprobs(x, packed, bad, tokens, 1)
    with pytest.raises(RuntimeError, match=r"tokens\[0\] is 64, outside \[0, 64\)"):
        cpu.gemm_linear_logprobs(x[:1].contiguous(), packed, 64, torch.tensor([64]), 1)


def test_bf16_weights_on_the_float32_kernel_give_what_their_float32_copies_give(ops):
    """A bf16 model on a CPU without bf16 dot products keeps its bf16 weights, packed for the
    float32 kernel (``gemm_pack(w, float32_kernel=True)``), which widens each block as it goes:
    bitwise the float32 copies' results in every GEMM form, at every row count, from half the
    bytes. float32 x holding the bf16 values (widened already, as the layer stack hands them over)
    gives the same bits, and gate/up can write its bf16 result into float32 (the down projection's
    input)."""
    from pagoda_kernels.layer_ops import interleave_gate_up

    cpu = _gemm_ops(ops, torch.float32)
    g = torch.Generator().manual_seed(5)
    for n, k in [(960, 576), (576, 1536), (64, 7)]:
        w = (0.05 * torch.randn(n, k, generator=g)).to(torch.bfloat16)
        narrow, wide = cpu.gemm_pack(w, float32_kernel=True), cpu.gemm_pack(w.float())
        assert narrow.dtype == torch.bfloat16 and narrow.shape == wide.shape
        # each k's columns of a panel, reordered for widening in registers
        assert torch.equal(narrow.float().sort(-1).values, wide.sort(-1).values)
        x = torch.randn(600, k, generator=g).to(torch.bfloat16)
        full = cpu.gemm_linear(x, narrow)
        assert torch.equal(full, cpu.gemm_linear(x, wide))
        for rows in (*range(1, 13), 40, 257):
            assert torch.equal(cpu.gemm_linear(x[-rows:].contiguous(), narrow), full[-rows:])
        widened = cpu.gemm_linear(x.float(), narrow)
        assert widened.dtype == torch.bfloat16 and torch.equal(widened, full)
        assert torch.equal(cpu.gemm_linear_argmax(x.float(), narrow, n), cpu.gemm_linear_argmax(x, narrow, n))
        with pytest.raises(RuntimeError, match="out must be bf16"):
            torch.ops.pagoda_cpu.gemm_linear(x.float(), narrow, torch.empty(600, n))
    w = (0.05 * torch.randn(512, 576, generator=g)).to(torch.bfloat16)
    x = (3 * torch.randn(300, 576, generator=g)).to(torch.bfloat16)
    gate_up = interleave_gate_up(w)
    narrow = cpu.gemm_pack(gate_up, float32_kernel=True)
    want = cpu.gemm_linear_silu_mul(x, narrow)
    assert torch.equal(want, cpu.gemm_linear_silu_mul(x, cpu.gemm_pack(gate_up.float())))
    assert torch.equal(cpu.gemm_linear_silu_mul(x.float(), narrow), want)
    for xs in (x, x.float()):
        into_f32 = torch.empty(300, 256)
        torch.ops.pagoda_cpu.gemm_linear_silu_mul(xs, narrow, into_f32)
        assert torch.equal(into_f32, want.float())
    heads, kvh, dim, max_pos, blocks, bs = 9, 3, 64, 512, 40, 16
    cos_t, sin_t = _rope_tables(dim, max_pos)
    w = (0.05 * torch.randn((heads + 2 * kvh) * dim, 576, generator=g)).to(torch.bfloat16)
    rope = cpu.rope_inputs(torch.randint(0, max_pos, (300,), generator=g), cos_t, sin_t, torch.bfloat16)
    slots = torch.randperm(blocks * bs, generator=g)[:293]
    results = []
    narrow = cpu.gemm_pack(w, float32_kernel=True)
    for xs, packed in ((x, narrow), (x, cpu.gemm_pack(w.float())), (x.float(), narrow)):
        kc, vc = (torch.zeros(blocks, bs, kvh, dim, dtype=torch.bfloat16) for _ in range(2))
        results.append((cpu.gemm_linear_rotary_qkv_to_cache(xs, packed, rope, heads, kc, vc, slots), kc, vc))
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    assert results[0][1].abs().sum() > 0


@pytest.fixture
def stalled_gemm_thread():
    """Two threads in every GEMM call, the second sleeping 20 ms before it starts (as if the OS had
    preempted it: the engine service's event loop, a neighbour on the host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield lambda on: torch.ops.pagoda_cpu.gemm_test_stall(1 if on else -1, 20_000)
    torch.ops.pagoda_cpu.gemm_test_stall(-1, 0)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype,w_dtype", GEMM_FORMS)
def test_a_stalled_gemm_threads_work_is_taken_by_the_other_with_the_same_results(ops, stalled_gemm_thread,
                                                                                 dtype, w_dtype):
    """The thread that is not held up takes the back of the stalled one's share (whole groups, then
    half of what is left of one) and every form gives the same bits as with both threads running."""
    from pagoda_kernels.layer_ops import interleave_gate_up

    cpu = _gemm_ops(ops, w_dtype)
    g = torch.Generator().manual_seed(11)
    heads, kvh, dim, k, max_pos, blocks, bs = 9, 3, 64, 576, 512, 80, 16
    cos_t, sin_t = _rope_tables(dim, max_pos)
    w = (0.05 * torch.randn(1536, k, generator=g)).to(w_dtype)
    w_qkv = (0.05 * torch.randn((heads + 2 * kvh) * dim, k, generator=g)).to(w_dtype)
    packed, packed_gate_up, packed_qkv = cpu.gemm_pack(w), cpu.gemm_pack(interleave_gate_up(w)), cpu.gemm_pack(w_qkv)
    for rows in (1, 13, 300, 600):
        x = torch.randn(rows, k, generator=g).to(dtype)
        rope = cpu.rope_inputs(torch.randint(0, max_pos, (rows,), generator=g), cos_t, sin_t, dtype)
        slots = torch.randperm(blocks * bs, generator=g)[:rows]

        def run():
            kc, vc = (torch.zeros(blocks, bs, kvh, dim, dtype=dtype) for _ in range(2))
            q = cpu.gemm_linear_rotary_qkv_to_cache(x, packed_qkv, rope, heads, kc, vc, slots)
            return cpu.gemm_linear(x, packed), cpu.gemm_linear_silu_mul(x, packed_gate_up), q, kc, vc

        stalled_gemm_thread(False)
        want = run()
        steals = torch.ops.pagoda_cpu.gemm_steals()
        stalled_gemm_thread(True)
        got = run()
        assert torch.ops.pagoda_cpu.gemm_steals() >= steals + 3  # at least one a call
        assert all(torch.equal(a, b) for a, b in zip(got, want)), rows
    with pytest.raises(RuntimeError, match=r"microseconds must be in \[0, 1e6\]"):
        torch.ops.pagoda_cpu.gemm_test_stall(1, -1)


@pytest.mark.parametrize("dtype,w_dtype", GEMM_FORMS)
def test_gemm_trace_records_every_claim_once_and_only_while_on(ops, dtype, w_dtype):
    """bench/gemm_trace.py's source: with the trace on, a call's claims cover each (column group,
    row) pair once, inside its threads' regions, with ordered time stamps, and its rows carry the
    call's shape (column groups, blocks a group, K: what names the GEMM in a layer); off, nothing
    is kept."""
    from pagoda_kernels.layer_ops import interleave_gate_up

    cpu = _gemm_ops(ops, w_dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(5)
        rows, k, n = 300, 576, 640  # two 256-row slices, ten 64-column blocks
        x = torch.randn(rows, k, generator=g).to(dtype)
        packed = cpu.gemm_pack((0.05 * torch.randn(n, k, generator=g)).to(w_dtype))
        gate_up = cpu.gemm_pack(interleave_gate_up((0.05 * torch.randn(2 * n, k, generator=g)).to(w_dtype)))
        torch.ops.pagoda_cpu.gemm_trace(False)
        cpu.gemm_linear(x, packed)
        assert torch.ops.pagoda_cpu.gemm_trace(True).shape == (0, 7)  # off: nothing recorded
        want = cpu.gemm_linear(x, packed)
        trace = torch.ops.pagoda_cpu.gemm_trace(True).tolist()
        want_act = cpu.gemm_linear_silu_mul(x, gate_up)
        trace_act = torch.ops.pagoda_cpu.gemm_trace(False).tolist()
        assert torch.equal(cpu.gemm_linear(x, packed), want) and torch.ops.pagoda_cpu.gemm_trace(False).shape == (0, 7)
        assert torch.equal(cpu.gemm_linear_silu_mul(x, gate_up), want_act)
    finally:
        torch.set_num_threads(threads)
    groups = n // 64  # gate/up too: its 2n columns are n // 64 pairs of gate and up blocks
    for got, group in ((trace, 1), (trace_act, 2)):
        regions = [r for r in got if r[1] == -1]
        claims = [r for r in got if r[1] != -1]
        assert sorted(r[0] for r in regions) == [0, 1] and all(r[2] == 2 and r[3] <= r[4] for r in regions)
        assert all(r[5:] == [groups, k] for r in regions), regions
        per_group = [0] * groups
        for t, g_, claimed, t0, t1, t2, blocks in claims:
            region = next(r for r in regions if r[0] == t)
            assert region[3] <= t0 <= t1 <= t2 <= region[4] and blocks == group
            per_group[g_] += claimed
        assert per_group == [rows] * groups


def test_gemm_trace_names_each_gemm_of_a_layer_by_its_shape():
    """bench/gemm_trace.py names a traced call from the shape the trace carries, so a GEMM that
    ran elsewhere (oneDNN) leaves a gap instead of shifting every later name."""
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[1] / "bench" / "gemm_trace.py"
    spec = importlib.util.spec_from_file_location("pagoda_bench_gemm_trace", path)
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    for cfg in (SimpleNamespace(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,  # SmolLM2-135M
                                intermediate_size=1536, vocab_size=49152),
                SimpleNamespace(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,  # no GQA
                                intermediate_size=640, vocab_size=1024)):
        h, inter = cfg.hidden_size, cfg.intermediate_size
        qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * (h // cfg.num_attention_heads)
        shapes = {"qkv": (qkv // 64, 1, h), "o_proj": (h // 64, 1, h), "gate_up": (2 * inter // 64, 2, h),
                  "down": (h // 64, 1, inter), "lm_head": (cfg.vocab_size // 64, 1, h)}
        assert {name: trace.kind_of(*shape, cfg) for name, shape in shapes.items()} == {n: n for n in shapes}


@pytest.mark.parametrize("dtype", GEMM_DTYPES)
def test_gemms_reject_bad_shapes(ops, dtype):
    cpu = _gemm_ops(ops, dtype)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        cpu.gemm_pack(torch.zeros(100, 64, dtype=dtype))
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        cpu.gemm_pack(torch.zeros(64, 32, dtype=torch.float16))
    packed = cpu.gemm_pack(torch.zeros(64, 32, dtype=dtype))
    with pytest.raises(RuntimeError, match="K = 48"):
        cpu.gemm_linear(torch.zeros(2, 48, dtype=dtype), packed)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    # x of a dtype the weight does not take (float32 weights take bf16 x too, not float16)
    refused = torch.float32 if dtype == torch.bfloat16 else torch.float16
    with pytest.raises(RuntimeError, match="x must be .* got (Float|Half)"):
        cpu.gemm_linear(torch.zeros(2, 32, dtype=refused), packed)
    with pytest.raises(RuntimeError, match="out must be (bf16|float32) .the model dtype"):
        torch.ops.pagoda_cpu.gemm_linear(torch.zeros(2, 32, dtype=dtype), packed, torch.zeros(2, 64, dtype=other))
    if dtype == torch.bfloat16:
        with pytest.raises(RuntimeError, match="even stride"):  # rows are read as pairs of k
            cpu.gemm_linear(torch.zeros(2, 33, dtype=torch.bfloat16)[:, :32], packed)
