"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, SmolLM) over a flattened ragged batch.

The forward takes the step's new tokens back to back (no padding) with their positions; each
attention layer writes their K/V into the paged cache and reads the context through block tables.
Q/K/V and gate/up projections are fused into one matmul each at load time. On CPU the decoder
layers usually run in one C++ call a step (``LlamaForCausalLM.build_layer_stack``); the Python
layers below are what it computes, and run where it does not apply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagoda_kernels.attention import AttentionMetadata
from pagoda_kernels.layer_ops import LAYER_WEIGHTS, TorchLayerOps, interleave_gate_up

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def pack_cpu_weight(weight: torch.Tensor, batch_hint: int) -> torch.Tensor | None:
    """``weight`` [out, in] reordered into oneDNN's blocked GEMM layout (an opaque mkldnn tensor
    for ``packed_linear``), or None where this torch build has no oneDNN.

    On CPU, ``F.linear`` hands a plain weight to MKL (float32) or oneDNN (bfloat16), which re-block
    it inside every call; a weight blocked once at load time runs the model's GEMMs 5-15% faster in
    bfloat16 (same results: both are oneDNN) and 20-40% faster in float32 (bench/RESULTS.md)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint)
    except (RuntimeError, AttributeError):
        return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: bool = False) -> torch.Tensor:
    """x @ weight.T + bias; a weight wider than x (see ``Linear``) multiplies x widened, and the
    output is rounded back to x's dtype. ``packed``: weight comes from ``pack_cpu_weight``."""
    wide = weight.dtype != x.dtype
    xw = x.to(weight.dtype) if wide else x
    if packed:
        y = torch.ops.mkldnn._linear_pointwise(xw, weight, bias, "none", [], "")
    else:
        y = F.linear(xw, weight, bias)
    return y.to(x.dtype) if wide else y


class Linear(nn.Linear):
    """nn.Linear whose weight may be wider than the activations: a bfloat16 model on a CPU without
    bf16 dot products keeps float32 copies of its bf16 weights (exact) and multiplies in float32,
    rounding the output back to bf16 — bf16 operands with fp32 accumulation, as a bf16 GEMM does.

    After ``pack()`` (CPU) the weight lives only in oneDNN's blocked layout (``pack_cpu_weight``)."""

    packed_weight: torch.Tensor | None = None
    gemm_weight: torch.Tensor | None = None  # pack_gemm: the weight for ops.gemm_linear
    gemm_ops = None

    def gemm_packable(self) -> bool:
        dtype = self.weight.dtype
        return (self.bias is None and dtype in (torch.bfloat16, torch.float32) and self.out_features % 64 == 0
                and (self.in_features % 2 == 0 or dtype == torch.float32))

    def pack_gemm(self, ops, float32_kernel: bool = False) -> bool:
        """Keep the weight in the layout of Pagoda's GEMMs too: ``forward`` multiplies up to
        ``ops.gemm_max_rows`` rows with ``ops.gemm_linear``, and only there where that has no limit
        (the plain weight is dropped). ``float32_kernel``: a bf16 weight for the float32 kernel (see
        ``ops.gemm_pack``). False if the layer does not qualify."""
        if not self.gemm_packable():
            return False
        self.gemm_weight, self.gemm_ops = ops.gemm_pack(self.weight, float32_kernel), ops
        if ops.gemm_max_rows is None:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def takes_gemm(self, rows: int) -> bool:
        """Whether ``rows`` rows go to ``ops.gemm_linear`` (or a fused form of it)."""
        if self.gemm_weight is None:
            return False
        limit = self.gemm_ops.gemm_max_rows
        return limit is None or rows <= limit

    def pack(self, batch_hint: int) -> bool:
        """Reorder the weight for oneDNN once and drop the plain copy; False if not possible."""
        packed = pack_cpu_weight(self.weight, batch_hint)
        if packed is None:
            return False
        self.packed_weight = packed
        # Keep an empty parameter of the same dtype so the module still reports what it computes in.
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.takes_gemm(x.shape[0]) and x.dtype in (self.gemm_weight.dtype, torch.bfloat16):
            # (bf16 x on a float32 weight: widened, the output rounded to bf16, as linear() does)
            return self.gemm_ops.gemm_linear(x, self.gemm_weight)
        if self.packed_weight is not None:
            return linear(x, self.packed_weight, self.bias, packed=True)
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same operation order as transformers' LlamaRMSNorm (fp32 statistics, cast, then scale).
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _rope_tables(config, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [max_positions, head_dim] in fp32, exactly as transformers computes them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        base = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        scaling = 1.0
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


@dataclass
class KeptRows:
    """The rows of a step whose final hidden state is needed (the sampled ones), for the last
    layer: ``rows`` ascending, every decode row first (the decode kernel takes them all, a
    speculative decode's positions included), then each sampled prefill chunk's last row;
    ``index``: ``rows`` padded to the GEMM row multiple; ``meta``: the attention metadata of
    those rows alone (the kept suffixes as the chunks, chunks with none dropped)."""

    rows: torch.Tensor
    index: torch.Tensor
    meta: AttentionMetadata


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        # Qwen2 has q/k/v biases only; Llama's attention_bias puts one on all four projections.
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=bias or config.model_type == "qwen2")
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=bias and config.model_type != "qwen2")
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                attn, ops: TorchLayerOps, keep: KeptRows | None = None) -> torch.Tensor:
        """Attention over the step's rows; with ``keep``, K/V are still written for every row but
        the attention and o_proj run only on ``keep.rows`` (returns [len(keep.index), hidden])."""
        t = x.shape[0]
        key_cache, value_cache = kv_cache
        # Rows past the step's tokens are padding (LlamaForCausalLM.gemm_row_multiple): no K/V, no attention.
        tr = meta.slot_mapping.shape[0]
        q = k = v = None  # k / v stay None where they live only in the cache (the backend reads them there)
        fused = not self.qk_norm and attn.prefill_reads_cache(x.dtype)
        if fused and self.head_dim == 64 and self.qkv_proj.takes_gemm(t):
            q = self.qkv_proj.gemm_ops.gemm_linear_rotary_qkv_to_cache(
                x, self.qkv_proj.gemm_weight, rope, self.num_heads, key_cache, value_cache, meta.slot_mapping)
            qkv = None
        else:
            qkv = self.qkv_proj(x)
            if fused:
                q = ops.rotary_qkv_to_cache(qkv, rope, self.num_heads, key_cache, value_cache, meta.slot_mapping)
        if q is not None and tr != t:
            q = q[:tr]
        if q is None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(t, self.num_heads, self.head_dim)
            k = k.view(t, self.num_kv_heads, self.head_dim)
            v = v.view(t, self.num_kv_heads, self.head_dim)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q = ops.rotary(q, rope)
            k = ops.rotary(k, rope)
            if tr != t:
                q, k, v = q[:tr], k[:tr], v[:tr]
            attn.write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        if keep is not None:
            q, k, v = (None if a is None else a.index_select(0, keep.rows) for a in (q, k, v))
            t, tr, meta = keep.index.shape[0], keep.rows.shape[0], keep.meta
        nd = meta.num_decode_tokens
        # Decode rows, then prefill rows, then padding rows, written in place (no cat / pad copies).
        out = q.new_empty(t, self.num_heads, self.head_dim)
        if nd:
            attn.decode(q[:nd], key_cache, value_cache, meta, self.scale, out=out[:nd])
        if nd < tr:
            kp, vp = (None, None) if k is None else (k[nd:], v[nd:])
            attn.prefill(q[nd:], kp, vp, key_cache, value_cache, meta, self.scale, out=out[nd:tr])
        if tr != t:
            out[tr:].zero_()
        return self.o_proj(out.view(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_gemm: torch.Tensor | None = None  # pack_gemm
        self.gemm_ops = None

    def pack_gemm(self, ops, float32_kernel: bool = False) -> bool:
        """gate/up on Pagoda's GEMM with silu * up fused (``ops.gemm_linear_silu_mul``) at every
        row count: the weight is kept only in that layout. False if the layer does not qualify."""
        if not self.gate_up_proj.gemm_packable() or self.intermediate_size % 64:
            return False
        self.gate_up_gemm = ops.gemm_pack(interleave_gate_up(self.gate_up_proj.weight), float32_kernel)
        self.gemm_ops = ops
        self.gate_up_proj.weight = nn.Parameter(self.gate_up_proj.weight.new_empty(0), requires_grad=False)
        return True

    def forward(self, x: torch.Tensor, ops: TorchLayerOps) -> torch.Tensor:
        if self.gate_up_gemm is not None:
            return self.down_proj(self.gemm_ops.gemm_linear_silu_mul(x, self.gate_up_gemm))
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope, kv_cache, meta, attn,
                ops: TorchLayerOps, keep: KeptRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before adding it): the next
        layer's norm adds the two, fused (``ops.rms_norm``). With ``keep`` both are only for the
        rows ``keep.index`` selects."""
        if residual is None:
            residual = h
            x = ops.rms_norm(h, None, self.input_layernorm.weight, self.input_layernorm.eps)
        else:
            x = ops.rms_norm(h, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        x = self.self_attn(x, rope, kv_cache, meta, attn, ops, keep)
        if keep is not None:
            residual = residual.index_select(0, keep.index)
        x = ops.rms_norm(x, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp(x, ops), residual


class LlamaForCausalLM(nn.Module):
    """The model: ``forward`` returns final hidden states; ``compute_logits`` applies the LM head."""

    def __init__(self, config, max_positions: int):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        self.embed_tokens_matmul_weight: torch.Tensor | None = None
        self.tied_lm_head_packed: torch.Tensor | None = None  # pack_weights()
        # pack_gemm_weights(float32_kernel=True): the tied LM head's bf16 weight on our float32 kernel
        self.tied_lm_head_gemm: torch.Tensor | None = None
        self.gemm_ops = None
        # GEMM inputs that oneDNN multiplies are padded with rows up to a multiple of this
        # (pack_weights sets 8 where it multiplies any of them; gemm_pad): oneDNN builds a primitive
        # per row count on first use (~2 ms per weight shape on a 2-core Xeon), and as requests
        # finish nearly every decode step has a new count (~10 ms a step before this). Pagoda's
        # GEMMs take any row count as it is: padding them only adds rows to multiply (a
        # one-sequence step's 1 row became 8).
        self.gemm_row_multiple = 1
        # A layer Linear packed for oneDNN (pack_weights): one without a weight for our GEMMs where
        # there is one, else one that has both; the layers' GEMMs take oneDNN at the row counts
        # where it does (Linear.takes_gemm). None: no layer GEMM runs on oneDNN.
        self.onednn_layer_linear: Linear | None = None
        # The decoder layers' weights for ops.decoder_layers (build_layer_stack): forward then runs
        # them in one C++ call instead of layer by layer from Python. None: the Python layers.
        self.layer_stack: list[torch.Tensor] | None = None
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        cos, sin = _rope_tables(config, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata, attn,
                ops: TorchLayerOps | None = None, keep: KeptRows | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of the step's rows, or with ``keep`` of ``keep.rows``
        only: the last layer then runs its attention, o_proj and MLP on those rows alone (every
        row's K/V is still cached). The kept rows' values are the same either way: each op is
        row-wise."""
        ops = ops or TorchLayerOps()
        t = input_ids.shape[0]
        pad = self.gemm_pad(t)
        if pad:  # padding rows: token 0 at position 0, dropped again by the caller
            input_ids = F.pad(input_ids, (0, pad))
            positions = F.pad(positions, (0, pad))
        h = self.embed_tokens(input_ids)
        rope = ops.rope_inputs(positions, self.rope_cos, self.rope_sin, h.dtype)
        residual = None
        last = len(self.layers) - 1
        start = 0
        attn_tensors = (attn.kernel_tensors(meta, h.dtype)
                        if self.layer_stack is not None and ops.runs_decoder_layers else None)
        if attn_tensors is not None:
            # Every layer in one C++ call, but the last where it runs on the kept rows only.
            start = last if keep is not None else last + 1
            n = len(LAYER_WEIGHTS)
            a = self.layers[0].self_attn
            h, residual = ops.decoder_layers(
                h, None, self.layer_stack[:start * n], [c for pair in kv_caches[:start] for c in pair], rope,
                meta.slot_mapping, meta.num_decode_tokens, attn_tensors, a.num_heads,
                self.layers[0].input_layernorm.eps, a.scale)
        for i in range(start, last + 1):
            h, residual = self.layers[i](h, residual, rope, kv_caches[i], meta, attn, ops,
                                         keep if i == last else None)
        if keep is not None:
            t = keep.rows.shape[0]
        return ops.rms_norm(h, residual, self.norm.weight, self.norm.eps)[:t]

    def build_layer_stack(self, ops: TorchLayerOps) -> bool:
        """Have ``forward`` run the decoder layers through ``ops.decoder_layers`` (one C++ call a
        step) where every layer is what that call computes: no biases or q/k norms, norms sharing
        one eps, each projection on our bf16 GEMM and/or a oneDNN-packed weight of the activations'
        dtype or float32 (our GEMM's with a row limit needs oneDNN's beside it). Call after
        ``pack_weights``; False (the Python layers) where anything differs."""
        self.layer_stack = None
        if not ops.runs_decoder_layers or not self.layers:
            return False
        dtype = self.embed_tokens.weight.dtype
        if dtype not in (torch.float32, torch.bfloat16):  # the fused rotary / K/V write's dtypes
            return False
        limited = ops.gemm_max_rows is not None
        empty = torch.empty(0, dtype=dtype)

        def onednn(linear: Linear) -> torch.Tensor:
            # bf16 activations on a float32 weight (CPUs without bf16 dot products): the call widens
            # x and rounds the output back, as ``linear`` does.
            w = linear.packed_weight
            return w if w is not None and w.dtype in (dtype, torch.float32) else empty

        def ours(linear: Linear) -> torch.Tensor:
            return linear.gemm_weight if linear.gemm_weight is not None else empty

        eps = self.layers[0].input_layernorm.eps
        weights = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if (attn.qk_norm or attn.head_dim % 2 or any(p.bias is not None for p in projections)
                    or {layer.input_layernorm.eps, layer.post_attention_layernorm.eps} != {eps}):
                return False
            gate_up = mlp.gate_up_gemm if mlp.gate_up_gemm is not None else empty
            pairs = [(ours(attn.qkv_proj), onednn(attn.qkv_proj)), (ours(attn.o_proj), onednn(attn.o_proj)),
                     (gate_up, onednn(mlp.gate_up_proj)), (ours(mlp.down_proj), onednn(mlp.down_proj))]
            # Each projection needs oneDNN's weight unless ours takes every row count (gate/up always does).
            every_row = (not limited, not limited, True, not limited)
            if any(not dnn.numel() and not (gemm.numel() and every) for (gemm, dnn), every in zip(pairs, every_row)):
                return False
            norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            if any(w.dtype != dtype for w in norms):
                return False
            weights += norms + [w for pair in pairs for w in pair]
        self.layer_stack = weights
        return True

    def gemm_pad(self, rows: int, lm_head: bool = False) -> int:
        """Rows to add to a GEMM input of ``rows`` rows (the layers', or with ``lm_head`` the LM
        head's): up to a multiple of ``gemm_row_multiple`` where oneDNN multiplies that many, none
        where Pagoda's GEMMs do (on a CPU with AMX the layers' GEMMs up to ``gemm_max_rows`` rows,
        the LM head at any count; everywhere else all of them or none)."""
        if self.gemm_row_multiple == 1 or not rows % self.gemm_row_multiple:
            return 0
        if lm_head:
            head = None if self.tie_word_embeddings else self.lm_head
            onednn = (self.tied_lm_head_packed is not None if head is None
                      else head.packed_weight is not None and not head.takes_gemm(rows))
        else:
            linear = self.onednn_layer_linear
            onednn = linear is not None and not linear.takes_gemm(rows)
        return -rows % self.gemm_row_multiple if onednn else 0

    def kept_rows(self, rows: torch.Tensor, meta: AttentionMetadata) -> KeptRows:
        """``KeptRows`` for the ascending row indices ``rows`` (see there)."""
        m = rows.shape[0]
        pad = self.gemm_pad(m)
        index = F.pad(rows, (0, pad)) if pad else rows  # padding rows repeat row 0, dropped after
        return KeptRows(rows, index, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype (the sampler widens them only when it does more than argmax).
        A wider weight's output is rounded to the model dtype first, as a bf16 LM head's output
        is (greedy ties break alike)."""
        n = hidden.shape[0]
        pad = self.gemm_pad(n, lm_head=True)
        if pad:
            hidden = F.pad(hidden, (0, 0, 0, pad))
        if not self.tie_word_embeddings:
            logits = self.lm_head(hidden)
        elif self.tied_lm_head_gemm is not None:
            logits = self.gemm_ops.gemm_linear(hidden, self.tied_lm_head_gemm)
        elif self.tied_lm_head_packed is not None:
            logits = linear(hidden, self.tied_lm_head_packed, packed=True)
        else:
            weight = self.embed_tokens_matmul_weight if self.embed_tokens_matmul_weight is not None \
                else self.embed_tokens.weight
            logits = linear(hidden, weight)
        return logits[:n]

    def greedy_tokens(self, hidden: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """argmax(compute_logits(hidden)[:, :vocab_size], -1), bit for bit, straight from the LM
        head's GEMM where it runs on ours (``gemm_linear_argmax``: the logits are never written);
        None where it does not (the caller then takes the argmax of ``compute_logits``)."""
        if self.tie_word_embeddings:
            if self.tied_lm_head_gemm is None:
                return None
            return self.gemm_ops.gemm_linear_argmax(hidden, self.tied_lm_head_gemm, vocab_size)
        head = self.lm_head
        if not (head.takes_gemm(hidden.shape[0]) and hidden.dtype in (head.gemm_weight.dtype, torch.bfloat16)):
            return None
        return head.gemm_ops.gemm_linear_argmax(hidden, head.gemm_weight, vocab_size)

    def logprobs_from_hidden(self, hidden: torch.Tensor, tokens: torch.Tensor, k: int, vocab_size: int):
        """The sampler's ``logprobs(compute_logits(hidden)[:, :vocab_size], tokens, k)`` straight from
        the LM head's GEMM where it runs on ours (``gemm_linear_logprobs``: the logits are never
        written); None where it does not."""
        if self.tie_word_embeddings:
            if self.tied_lm_head_gemm is None:
                return None
            return self.gemm_ops.gemm_linear_logprobs(hidden, self.tied_lm_head_gemm, vocab_size, tokens, k)
        head = self.lm_head
        if not (head.takes_gemm(hidden.shape[0]) and hidden.dtype in (head.gemm_weight.dtype, torch.bfloat16)):
            return None
        return head.gemm_ops.gemm_linear_logprobs(hidden, head.gemm_weight, vocab_size, tokens, k)

    def pack_gemm_weights(self, ops, float32_kernel: bool = False) -> None:
        """Pack the decoder layers' weights for Pagoda's own GEMMs (``Linear.pack_gemm``,
        ``LlamaMLP.pack_gemm``: gate/up only there, every layer only there where ``gemm_max_rows``
        is None). ``float32_kernel``: the bf16 weights go to the float32 kernel as they are (a bf16
        model on a CPU without bf16 dot products, before ``set_matmul_dtype`` widens what is left:
        half the memory of float32 copies, the same bits; ``ops.gemm_pack``). The LM head goes there
        too (on the float32 kernel faster than oneDNN on a float32 copy at every row count a step
        hands it; on AVX512-BF16 as fast as oneDNN and, like every GEMM of ours, not held up by a
        preempted thread: bench/RESULTS.md); with AMX as fast as oneDNN in a run of the shared
        workload, and there too greedy rows then take their argmax in the GEMM (``greedy_tokens``).
        A float32 model's tied head takes the float32 kernel on its table (untied heads already
        did): with the argmax inside, 1.11-1.24x oneDNN's GEMM plus the argmax at 8-256 rows on Zen 5,
        W in float32 +1.3% (four pairs, 1.001-1.037; bench/RESULTS.md)."""
        for layer in self.layers:
            layer.mlp.pack_gemm(ops, float32_kernel)
            for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
                proj.pack_gemm(ops, float32_kernel)
        if not self.tie_word_embeddings:
            self.lm_head.pack_gemm(ops, float32_kernel)
        elif self.config.vocab_size % 64 == 0:
            self.tied_lm_head_gemm = ops.gemm_pack(self.embed_tokens.weight, float32_kernel=float32_kernel)
            self.gemm_ops = ops

    def pack_weights(self, batch_hint: int, gemm_ops=None) -> bool:
        """Reorder every GEMM weight (the LM head included) into oneDNN's blocked layout once
        (``pack_cpu_weight``); the plain copies are dropped. False where oneDNN is not available.

        ``gemm_ops`` (layer ops whose GEMMs take the weights' dtype: the activations', or float32
        weights under bf16 activations): ``pack_gemm_weights`` first."""
        if gemm_ops is not None:
            self.pack_gemm_weights(gemm_ops)
        if self.tie_word_embeddings and self.tied_lm_head_gemm is None:
            weight = self.embed_tokens_matmul_weight if self.embed_tokens_matmul_weight is not None \
                else self.embed_tokens.weight
            packed = pack_cpu_weight(weight, batch_hint)
            if packed is None:
                return False
            self.tied_lm_head_packed, self.embed_tokens_matmul_weight = packed, None
        # A weight kept only in our GEMMs' layout (Linear/LlamaMLP.pack_gemm) has none left to pack.
        linears = [m for m in self.modules() if isinstance(m, Linear) and m.weight.numel()]
        packed = all([m.pack(batch_hint) for m in linears])
        if packed and (linears or self.tied_lm_head_packed is not None):
            self.gemm_row_multiple = 8
            in_layers = [m for m in self.layers.modules() if isinstance(m, Linear) and m.packed_weight is not None]
            self.onednn_layer_linear = min(in_layers, key=lambda m: m.gemm_weight is not None, default=None)
        return packed

    def set_matmul_dtype(self, dtype: torch.dtype) -> None:
        """Keep the linear layers' (and a tied LM head's) weights in ``dtype`` for their GEMMs; the
        activations, norms, embeddings and KV cache stay in the model dtype. (A weight already kept
        only in our GEMMs' layout, ``pack_gemm_weights``, has no plain copy left to convert.)"""
        for module in self.modules():
            if isinstance(module, Linear):
                module.to(dtype)
        if self.tie_word_embeddings and dtype != self.embed_tokens.weight.dtype and self.tied_lm_head_gemm is None:
            self.embed_tokens_matmul_weight = self.embed_tokens.weight.to(dtype)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, fusing q/k/v and gate/up into their stacked parameters."""
        params = dict(self.named_parameters())
        stacked = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                   "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in stacked:
                fused, shard = stacked[parts[-2]]
                target_name = ".".join(parts[:-2] + [fused, parts[-1]])
                param = params[target_name]
                offsets = self._shard_offsets(fused, parts[-1])
                start, size = offsets[shard]
                param.data.narrow(0, start, size).copy_(tensor)
                loaded.add((target_name, shard))
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            params[name].data.copy_(tensor)
            loaded.add((name, None))
        missing = [n for n in params if not any(key[0] == n for key in loaded)]
        if missing:
            raise ValueError(f"checkpoint is missing tensors: {missing[:5]}{' ...' if len(missing) > 5 else ''}")

    def _shard_offsets(self, fused: str, kind: str) -> list[tuple[int, int]]:
        if fused == "gate_up_proj":
            i = self.config.intermediate_size
            return [(0, i), (i, i)]
        attn = self.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        return [(0, q), (q, kv), (q + kv, kv)]
