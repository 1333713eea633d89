"""The Llama layer's elementwise ops: residual add + RMSNorm, rotary embedding, silu(gate) * up.

``TorchLayerOps`` is the reference (transformers' operation order, one torch op per step);
``CpuLayerOps`` runs each as one fused C++ pass over rows (``csrc/cpu_ops.cpp``, built with the
CPU attention extension), which replaces ~25 torch ops per layer per step by ~5: fewer passes
over memory and fewer OpenMP regions, which also makes a step far less sensitive to a busy host
(a parallel region waits for its slowest thread). Both give the same numbers up to the float32
summation order of the RMSNorm mean.

Rotary inputs are prepared once per forward (``rope_inputs``) and reused by every layer.
``CpuLayerOps.decoder_layers`` runs a whole stack of Llama layers on these kernels in one C++ call.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from .attention import CODED_CACHE_DTYPES, cache_head_dim

logger = logging.getLogger(__name__)

AMX_GEMM_MAX_ROWS = 1024  # CpuLayerOps.gemm_max_rows on a CPU with AMX
GEMM_BLOCK_N = 64  # output columns of a block of gemm_pack's layouts


class TorchLayerOps:
    """Plain torch ops, in transformers' order (the reference)."""

    name = "torch"
    bf16_gemm = False  # CpuLayerOps on a CPU with AVX512-BF16 or AMX-BF16: the gemm_* GEMMs below in bf16
    f32_gemm = False  # CpuLayerOps on a CPU with AVX2 and FMA: the gemm_* GEMMs in float32
    f32_gemm_preferred = False  # and the engine's default there (EngineConfig.cpu_f32_gemm None)
    gemm_max_rows: int | None = 0  # the most rows the model hands gemm_linear (None: any number)
    runs_decoder_layers = False  # CpuLayerOps: decoder_layers, a stack of Llama layers in one C++ call
    reads_one_byte_cache = False  # CpuLayerOps: its K/V writers take one-byte and int8 caches (bf16 or float32 rows)

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
        """RMSNorm(residual += x) if ``residual`` is given (updated in place), else RMSNorm(x)."""
        h = x if residual is None else residual.add_(x)
        dtype = h.dtype
        hf = h.float()
        hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * hf.to(dtype)

    def rope_inputs(self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
                    dtype: torch.dtype):
        cos = cos_table.index_select(0, positions).to(dtype)[:, None, :]
        sin = sin_table.index_select(0, positions).to(dtype)[:, None, :]
        return cos, sin

    def rotary(self, x: torch.Tensor, rope) -> torch.Tensor:
        """x [T, heads, D] -> x * cos + rotate_half(x) * sin (a new contiguous tensor)."""
        cos, sin = rope
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def rotary_qkv_to_cache(self, qkv: torch.Tensor, rope, num_heads: int, key_cache: torch.Tensor,
                            value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor | None:
        """The fused QKV projection's output [T, (H + 2 kv_heads) D] -> rotary(q) [T, H, D], with
        rotary(k) and v written straight to their cache slots (rows past len(slot_mapping): q only).
        None where there is no fused path: the caller then runs ``rotary`` and the backend's
        ``write_kv``."""
        return None

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [T, 2I] (the fused gate/up projection) -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy sampling: the index of each row's first maximum (int64 [N]; a NaN counts as the
        maximum). max(-1).indices: on bfloat16 logits several times faster than torch's argmax."""
        return logits.max(-1).indices

    # Random sampling in one pass a row (CpuLayerOps.sample); None here: the sampler's torch path.
    sample = None

    def logprobs(self, logits: torch.Tensor, tokens: torch.Tensor, k: int):
        """log_softmax of each row of ``logits`` [N, V] at its ``tokens`` [N] (float32 [N]), each
        token's rank in its row (int64 [N]: 1 + the logits above it), and the ``k`` largest logprobs
        of each row with their ids, largest first (int64 and float32 [N, k])."""
        x = logits.float()
        logprobs = x.log_softmax(-1)
        top, top_ids = logprobs.topk(k, dim=-1)
        rank = (x > x.gather(1, tokens.unsqueeze(1))).sum(-1) + 1
        return logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1), rank, top_ids, top


class CpuLayerOps(TorchLayerOps):
    """The same ops as single C++ passes (float32 and bfloat16; other dtypes use torch)."""

    name = "cpu"
    _DTYPES = (torch.float32, torch.bfloat16)

    def __init__(self) -> None:
        from .cpu_attention import load_extension

        load_extension()
        self._rms_norm = torch.ops.pagoda_cpu.rms_norm.default
        self._rotary = torch.ops.pagoda_cpu.rotary_embedding.default
        self._rotary_qkv_to_cache = torch.ops.pagoda_cpu.rotary_qkv_to_cache.default
        self._silu_and_mul = torch.ops.pagoda_cpu.silu_and_mul.default
        self._argmax = torch.ops.pagoda_cpu.argmax.default
        self._sample_rows = torch.ops.pagoda_cpu.sample_rows.default
        self._logprobs_rows = torch.ops.pagoda_cpu.logprobs_rows.default
        self._argmax_vectorized = bool(torch.ops.pagoda_cpu.has_avx512())
        self.bf16_gemm = bool(torch.ops.pagoda_cpu.gemm_supported())
        # Our float32 GEMM (AVX-512 panels of 6 rows x 64 columns where the build targets AVX-512, else
        # AVX2 panels of 6 x 16) is as fast as oneDNN's or faster at the model's shapes: 2-core Zen 3
        # 1.0-1.2x a GEMM, W in float32 +3%; 2-core Zen 4 (AVX-512) 1.0-1.7x, W in float32 +7%;
        # 2-core AMX Xeon 0.9-1.7x, W in float32 +4%; 2-core Zen 5 W in float32 +7.6% (bench/RESULTS.md).
        # EngineConfig.cpu_f32_gemm=False puts the GEMMs back on oneDNN.
        self.f32_gemm = bool(torch.ops.pagoda_cpu.gemm_f32_supported())
        self.f32_gemm_preferred = self.f32_gemm
        # With AMX, oneDNN's packed GEMM is faster above ~1024 rows (2-core Xeon, SmolLM2 shapes: the
        # AMX kernel 1.1-2.5x faster up to ~1024 rows, 0.7-0.9x at 2048); the AVX512-BF16 kernel is as
        # fast or faster at every row count (2-core Zen 4: 1.0-2.0x; bench/RESULTS.md). The fused
        # forms run at every row count either way.
        self.gemm_max_rows = AMX_GEMM_MAX_ROWS if torch.ops.pagoda_cpu.gemm_uses_amx() else None
        self._gemm_linear = torch.ops.pagoda_cpu.gemm_linear.default
        self._gemm_linear_silu_mul = torch.ops.pagoda_cpu.gemm_linear_silu_mul.default
        self._gemm_linear_argmax = torch.ops.pagoda_cpu.gemm_linear_argmax.default
        self._gemm_linear_logprobs = torch.ops.pagoda_cpu.gemm_linear_logprobs.default
        self._gemm_linear_rotary_to_cache = torch.ops.pagoda_cpu.gemm_linear_rotary_to_cache.default
        self._decoder_layers = torch.ops.pagoda_cpu.decoder_layers.default
        self.runs_decoder_layers = True
        self.reads_one_byte_cache = True

    def rms_norm(self, x, residual, weight, eps):
        if x.dtype not in self._DTYPES or x.dim() != 2 or x.stride(-1) != 1 or weight.dtype != x.dtype:
            return super().rms_norm(x, residual, weight, eps)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._rms_norm(x, residual, weight, eps, out)
        return out

    def rope_inputs(self, positions, cos_table, sin_table, dtype):
        return positions.contiguous(), cos_table, sin_table, dtype

    def rotary(self, x, rope):
        positions, cos_table, sin_table, dtype = rope
        if x.dtype not in self._DTYPES or x.stride(-1) != 1 or x.stride(1) != x.shape[2]:
            return super().rotary(x, super().rope_inputs(positions, cos_table, sin_table, dtype))
        out = torch.empty(x.shape, dtype=x.dtype)
        self._rotary(x, positions, cos_table, sin_table, out)
        return out

    def rotary_qkv_to_cache(self, qkv, rope, num_heads, key_cache, value_cache, slot_mapping):
        # One pass instead of rotary(q), rotary(k) and reshape_and_cache: no k temporary, one
        # parallel region instead of three (~90 -> ~50 us a layer in a 256-sequence decode step).
        positions, cos_table, sin_table, _ = rope
        coded = key_cache.dtype in CODED_CACHE_DTYPES and qkv.dtype in (torch.bfloat16, torch.float32)
        if (qkv.dtype not in self._DTYPES or qkv.dim() != 2 or qkv.stride(-1) != 1
                or not (key_cache.dtype == qkv.dtype or coded) or key_cache.device.type != "cpu" or not key_cache.is_contiguous()
                or not value_cache.is_contiguous() or slot_mapping.dtype != torch.int64):
            return None
        q = torch.empty((qkv.shape[0], num_heads, cache_head_dim(key_cache)), dtype=qkv.dtype)
        self._rotary_qkv_to_cache(qkv, positions, cos_table, sin_table, q, key_cache, value_cache,
                                  slot_mapping.contiguous())
        return q

    def silu_and_mul(self, gate_up):
        if gate_up.dtype not in self._DTYPES or gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return super().silu_and_mul(gate_up)
        out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
        self._silu_and_mul(gate_up, out)
        return out

    def argmax(self, logits):
        # One pass per row, rows over the threads (torch's bf16 max runs on one thread); the C++
        # loop is vectorised for AVX-512 only, so other CPUs keep torch's.
        if (not self._argmax_vectorized or logits.dtype not in self._DTYPES or logits.dim() != 2
                or logits.stride(-1) != 1 or logits.shape[1] == 0):
            return super().argmax(logits)
        out = torch.empty(logits.shape[0], dtype=torch.long)
        self._argmax(logits, out)
        return out

    def sample(self, logits, temperature, top_k, top_p, min_p, uniform, penalties=None, prompt=None, output=None,
               banned=None):
        """One token a row of ``logits`` [N, V] (float32 or bfloat16, rows contiguous): the argmax
        where ``temperature`` <= 0, else a draw from softmax(logits / temperature) kept to the
        tokens with probability >= ``min_p`` x the largest (0: off), then the ``top_k`` largest
        (0: off; ties kept), then the smallest top set with mass >= ``top_p`` (1: off; ties kept),
        taken at ``uniform`` (float64 in [0, 1)) of the kept tokens' cumulative mass in index order.
        Per-row tensors: temperature, top_p, min_p float32, top_k int64, uniform float64 [N].

        Before that, on a float copy of a row (``logits`` is left as it is): ``penalties`` (float32
        [N, 3]: repetition, frequency, presence; (1, 0, 0) for none) over ``prompt`` (repetition
        only) and ``output`` token ids, then -inf on ``banned`` ids. Each of those three is
        (ids int64 [M], starts int64 [N + 1]): row r's ids are ids[starts[r]:starts[r + 1]]."""
        out = torch.empty(logits.shape[0], dtype=torch.long)
        prompt, output, banned = ((None, None) if ids is None else ids for ids in (prompt, output, banned))
        self._sample_rows(logits, temperature, top_k, top_p, min_p, uniform, penalties, *prompt, *output, *banned, out)
        return out

    def logprobs(self, logits, tokens, k):
        # Two passes a row (csrc/cpu_ops.cpp logprobs_rows): the top k by a running threshold, then
        # the exp-sum; no [N, V] float copy, log_softmax or topk (256 x 49152: see bench/RESULTS.md).
        # Equal values come by lower index, and a NaN ranks lowest (torch.topk: highest).
        if logits.dtype not in self._DTYPES or logits.dim() != 2 or logits.stride(-1) != 1 or logits.shape[1] == 0:
            return super().logprobs(logits, tokens, k)
        n = logits.shape[0]
        token_lp, top_lp = torch.empty(n), torch.empty((n, k))
        rank, top_ids = torch.empty(n, dtype=torch.long), torch.empty((n, k), dtype=torch.long)
        self._logprobs_rows(logits, tokens.contiguous(), token_lp, rank, top_ids, top_lp)
        return token_lp, rank, top_ids, top_lp

    # ---- GEMMs of our own (csrc/cpu_ops.cpp): bf16 (bf16_gemm: AMX tiles or AVX512-BF16) and
    # float32 (f32_gemm: AVX-512 or AVX2 FMAs) ------------------------------------------------------

    def gemm_pack(self, weight: torch.Tensor, float32_kernel: bool = False) -> torch.Tensor:
        """weight [N, K] bf16 (N a multiple of 64, K even) or float32 (N a multiple of 64) in the
        kernels' layout, for the gemm_* GEMMs on activations of its dtype (float32 weights also take
        bf16 activations: widened, the output rounded to bf16). ``float32_kernel``: a bf16 weight
        kept in bf16 for the float32 kernel (a CPU without bf16 dot products): it takes bf16
        activations (or float32 ones holding bf16 values: widened already) and gives bitwise what
        the weight's float32 copy gives, from half the bytes."""
        return torch.ops.pagoda_cpu.gemm_pack_weight(weight.contiguous(), float32_kernel)

    def gemm_linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ weight.T in the model dtype (``gemm_dtype``), fp32 sums (rounded once to bf16
        in a bf16 model); a row's result does not depend on M."""
        out = torch.empty((x.shape[0], packed.shape[0] * GEMM_BLOCK_N), dtype=gemm_dtype(x, packed))
        self._gemm_linear(x, packed, out)
        return out

    def gemm_linear_argmax(self, x: torch.Tensor, packed: torch.Tensor, valid: int) -> torch.Tensor:
        """argmax(gemm_linear(x, packed)[:, :valid], -1) (first maximum, a NaN the maximum: as
        ``argmax``), bit for bit, without writing the logits: greedy sampling from the LM head."""
        out = torch.empty(x.shape[0], dtype=torch.long)
        self._gemm_linear_argmax(x, packed, valid, out)
        return out

    def gemm_linear_logprobs(self, x: torch.Tensor, packed: torch.Tensor, valid: int, tokens: torch.Tensor, k: int):
        """logprobs(gemm_linear(x, packed)[:, :valid], tokens, k) without writing the logits (prompt
        logprobs from the LM head): the same ids, ranks and top-k order, the logprobs up to the
        exp-sum's float summation order."""
        n = x.shape[0]
        token_lp, top_lp = torch.empty(n), torch.empty((n, k))
        rank, top_ids = torch.empty(n, dtype=torch.long), torch.empty((n, k), dtype=torch.long)
        self._gemm_linear_logprobs(x, packed, valid, tokens.contiguous(), token_lp, rank, top_ids, top_lp)
        return token_lp, rank, top_ids, top_lp

    def gemm_linear_silu_mul(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """silu_and_mul(x @ gate_up.T) in one pass; ``packed``: the gate/up weight with its 64-row
        blocks interleaved (``interleave_gate_up``) before ``gemm_pack``."""
        out = torch.empty((x.shape[0], packed.shape[0] // 2 * GEMM_BLOCK_N), dtype=gemm_dtype(x, packed))
        self._gemm_linear_silu_mul(x, packed, out)
        return out

    def gemm_linear_rotary_qkv_to_cache(self, x, packed, rope, num_heads, key_cache, value_cache, slot_mapping):
        """rotary_qkv_to_cache(x @ qkv.T, ...) in one pass (head_dim 64): returns rotary(q) [M, H, 64]."""
        positions, cos_table, sin_table, _ = rope
        q = torch.empty((x.shape[0], num_heads, cache_head_dim(key_cache)), dtype=gemm_dtype(x, packed))
        self._gemm_linear_rotary_to_cache(x, packed, positions, cos_table, sin_table, q, key_cache, value_cache,
                                         slot_mapping.contiguous())
        return q

    # ---- a stack of decoder layers in one call (LlamaForCausalLM.layer_stack) ---------------------

    def decoder_layers(self, h: torch.Tensor, residual: torch.Tensor | None, weights: list[torch.Tensor],
                       kv_caches: list[torch.Tensor], rope, slot_mapping: torch.Tensor, num_decode: int,
                       attn_tensors: tuple, num_heads: int, eps: float, scale: float):
        """What LlamaDecoderLayer.forward does, for each layer of ``weights`` (``LAYER_WEIGHTS`` a
        layer: norms, then each projection in our GEMM layout and oneDNN's, an empty tensor for the
        one it lacks) in one C++ call (``csrc/cpu_ops.cpp``, the same kernels, bitwise the same
        result). ``kv_caches``: each layer's key and value cache; ``attn_tensors``: the attention
        backend's ``kernel_tensors``. Returns (MLP output, residual stream) of the last layer."""
        positions, cos_table, sin_table, _ = rope
        limit = -1 if self.gemm_max_rows is None else self.gemm_max_rows
        return self._decoder_layers(h, residual, weights, kv_caches, positions, cos_table, sin_table,
                                    slot_mapping.contiguous(), num_decode, *attn_tensors, num_heads, eps, scale, limit)


LAYER_WEIGHTS = ("input_norm", "post_attention_norm", "qkv", "qkv_onednn", "o", "o_onednn", "gate_up",
                 "gate_up_onednn", "down", "down_onednn")  # CpuLayerOps.decoder_layers' weights of a layer


def gemm_dtype(x: torch.Tensor, packed: torch.Tensor) -> torch.dtype:
    """The model dtype of one of our GEMMs, which its outputs take: float32 only where both the
    activations and the weight are float32 (bf16 weights on the float32 kernel take float32
    activations holding bf16 values, widened already)."""
    return torch.float32 if x.dtype == packed.dtype == torch.float32 else torch.bfloat16


def interleave_gate_up(weight: torch.Tensor, block: int = 64) -> torch.Tensor:
    """The fused [gate; up] weight [2I, K] with gate rows block i at 2i and up rows block i at 2i + 1,
    so one thread's pair of blocks gives it the gate and up of the same output columns."""
    two_i, k = weight.shape
    return weight.view(2, two_i // 2 // block, block, k).transpose(0, 1).reshape(two_i, k).contiguous()


def get_layer_ops(device: torch.device, attention_backend: str = "auto") -> TorchLayerOps:
    """C++ fused ops on CPU (unless the torch reference was asked for), torch ops elsewhere."""
    if device.type == "cpu" and attention_backend in ("cpu", "auto"):
        try:
            return CpuLayerOps()
        except Exception as e:  # no compiler: still serve, slower
            logger.warning("fused CPU layer ops unavailable (%s); using torch ops", e)
    return TorchLayerOps()
