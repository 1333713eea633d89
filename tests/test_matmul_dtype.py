"""bfloat16 models on CPUs without bf16 dot products multiply in float32 on their (exactly widened)
bf16 weights: the choice, the layer arithmetic, and the engine's output against native bf16 GEMMs."""
from __future__ import annotations

import pytest
import torch

from engine_service import LLM, EngineConfig, SamplingParams
from engine_service.config import cpu_has_bf16_dot
from engine_service.models.llama import Linear


def test_auto_matmul_dtype_follows_the_cpu():
    cfg = EngineConfig(dtype="bfloat16")
    assert cfg.torch_matmul_dtype == (torch.bfloat16 if cpu_has_bf16_dot() else torch.float32)
    assert EngineConfig(dtype="float32").torch_matmul_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16", matmul_dtype="bfloat16").torch_matmul_dtype == torch.bfloat16
    assert EngineConfig(dtype="bfloat16", matmul_dtype="float32").torch_matmul_dtype == torch.float32
    with pytest.raises(ValueError, match="matmul_dtype"):
        EngineConfig(matmul_dtype="int8")


def test_cpu_f32_gemm_takes_none_true_or_false_only():
    for value in (None, True, False):
        assert EngineConfig(cpu_f32_gemm=value).cpu_f32_gemm is value
    for value in ("no", 0, 1):
        with pytest.raises(ValueError, match="cpu_f32_gemm must be None"):
            EngineConfig(cpu_f32_gemm=value)


def test_wide_weight_linear_is_a_bf16_gemm_with_fp32_accumulation():
    g = torch.Generator().manual_seed(0)
    layer = Linear(96, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g))
        layer.bias.copy_(torch.randn(40, generator=g))
    layer.to(torch.bfloat16)
    w16, b16 = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.to(torch.float32)  # what set_matmul_dtype does: bf16 values, exactly widened
    assert torch.equal(layer.weight.to(torch.bfloat16), w16)
    x = torch.randn(7, 96, generator=g).to(torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16
    expected = (x.double() @ w16.double().T + b16.double()).to(torch.bfloat16)
    # fp32 accumulation of exact bf16 products, one rounding to bf16 at the end: within 1 bf16 ulp.
    assert torch.allclose(y.double(), expected.double(), rtol=2 ** -7, atol=0)


def test_engine_bf16_with_fp32_matmuls_matches_native_bf16_logprobs(tiny_llama_dir):
    prompts = [{"prompt_token_ids": [(31 * i + 7 * j) % 40000 + 100 for j in range(n)]} for i, n in
               enumerate((3, 17, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = {}
    for md in ("bfloat16", "float32"):
        llm = LLM(tiny_llama_dir, dtype="bfloat16", matmul_dtype=md, max_model_len=256,
                  kv_cache_memory_bytes=16 << 20)
        runner = llm.llm_engine.runner
        assert runner.matmul_dtype == getattr(torch, md)
        down = runner.model.layers[0].mlp.down_proj
        if md == "float32" and runner.f32_gemm:  # the float32 kernel on the bf16 weights themselves
            assert down.weight.numel() == 0 and down.gemm_weight.dtype == torch.bfloat16
            assert down.gemm_weight.shape[-1] > 2  # the float32 kernel's panels, not bf16 pairs
            model = runner.model  # and so is the LM head, with no float32 copy of it
            head = model.tied_lm_head_gemm if model.tie_word_embeddings else model.lm_head.gemm_weight
            assert head is not None and head.dtype == torch.bfloat16
            assert model.embed_tokens_matmul_weight is None and model.tied_lm_head_packed is None
        else:
            assert down.weight.dtype == getattr(torch, md)
        assert runner.model.embed_tokens.weight.dtype == torch.bfloat16  # activations stay bf16
        assert runner.kv_cache.dtype == torch.bfloat16
        outs[md] = llm.generate(prompts, params, use_tqdm=False)
    for native, wide in zip(outs["bfloat16"], outs["float32"]):
        a, b = native.outputs[0], wide.outputs[0]
        # The first token's logprob differs only by summation order inside the GEMMs.
        assert a.token_ids[0] == b.token_ids[0]
        lp_a = a.logprobs[0][a.token_ids[0]].logprob
        lp_b = b.logprobs[0][b.token_ids[0]].logprob
        assert abs(lp_a - lp_b) < 0.05, (lp_a, lp_b)


@pytest.mark.parametrize("dtype, matmul_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                                 (torch.bfloat16, torch.float32)])
def test_packed_linear_computes_what_the_plain_one_does(dtype, matmul_dtype):
    g = torch.Generator().manual_seed(1)
    layer = Linear(96, 40, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(40, 96, generator=g))
        layer.bias.copy_(torch.randn(40, generator=g))
    layer.to(matmul_dtype)
    x = torch.randn(7, 96, generator=g).to(dtype)
    expected = layer(x)
    packed = layer.pack(batch_hint=16)
    if matmul_dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN blocks bf16 weights only where the CPU has bf16 conversions (AVX512BW/VL/DQ or
        # AVX-NE-CONVERT): elsewhere the layer keeps its plain weight and computes as before.
        assert not packed and layer.packed_weight is None and layer.weight.shape == (40, 96)
        assert torch.equal(layer(x), expected)
        return
    assert packed, "oneDNN packing is available in every CPU build Pagoda installs"
    assert layer.weight.numel() == 0 and layer.weight.dtype == matmul_dtype  # the plain copy is gone
    y = layer(x)
    assert y.dtype == dtype and y.shape == (7, 40)
    if matmul_dtype == torch.bfloat16:
        assert torch.equal(y, expected)  # oneDNN computes both: the same blocking, the same sums
    else:  # MKL vs oneDNN: float32 summation order only
        torch.testing.assert_close(y.float(), expected.float(), rtol=1e-5, atol=1e-5)
    for m in (1, 300):  # any row count, not just the hint
        xm = torch.randn(m, 96, generator=g).to(dtype)
        ref = (xm.to(matmul_dtype).double() @ layer.packed_weight.to_dense().double().T
               + layer.bias.double()).to(dtype)
        torch.testing.assert_close(layer(xm).double(), ref.double(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_packs_every_gemm_weight_on_cpu(tiny_llama_dir, dtype):
    llm = LLM(tiny_llama_dir, dtype=dtype, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    model = llm.llm_engine.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # Where Pagoda's GEMMs take the layers' weights (bf16: AVX512-BF16 or AMX; float32, a float32
    # model's or a bf16 model's on a CPU without bf16 dot products: AVX2 and FMA), gate/up
    # (and with no row limit every decoder layer's weight) lives only in their layout (LlamaMLP /
    # Linear.pack_gemm); every other weight is packed for oneDNN.
    runner = llm.llm_engine.runner
    ops = runner.layer_ops
    gemm_only = {id(layer.mlp.gate_up_proj) for layer in model.layers if layer.mlp.gate_up_gemm is not None}
    gemm_only |= {id(m) for m in linears if m.gemm_weight is not None and m.gemm_ops.gemm_max_rows is None}
    assert linears and all((m.packed_weight is not None or id(m) in gemm_only) and m.weight.numel() == 0
                           for m in linears)
    assert bool(gemm_only) == (ops.bf16_gemm if runner.matmul_dtype == torch.bfloat16 else ops.f32_gemm_preferred)
    if model.tie_word_embeddings:  # for oneDNN, or for our float32 kernel (a bf16 model without bf16 dot products)
        assert (model.tied_lm_head_packed is not None) != (model.tied_lm_head_gemm is not None)
    torch_dtype = getattr(torch, dtype)
    hidden = torch.randn(3, model.config.hidden_size).to(torch_dtype)
    ref = (hidden.double() @ model.embed_tokens.weight.double().T) if model.tie_word_embeddings else None
    logits = model.compute_logits(hidden)
    assert logits.shape == (3, model.config.vocab_size) and logits.dtype == torch_dtype  # widened by the sampler
    if ref is not None:
        torch.testing.assert_close(logits.double(), ref.to(torch_dtype).double(), rtol=2e-2, atol=5e-2)


def _cpu_layer_ops():
    from pagoda_kernels.layer_ops import get_layer_ops

    return get_layer_ops(torch.device("cpu"))


def _tiny_tied_bf16_model():
    """A one-layer bf16 Llama with a tied LM head over a 640-token vocabulary (10 GEMM blocks)."""
    from transformers import LlamaConfig

    from engine_service.models.llama import LlamaForCausalLM

    config = LlamaConfig(vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config, 64).to(torch.bfloat16).eval().requires_grad_(False)


def test_tied_lm_head_on_the_float32_kernel_keeps_its_bf16_weight():
    """A bf16 model with a tied LM head on our float32 kernel (``pack_gemm_weights(float32_kernel=
    True)``): the head multiplies the bf16 embedding table packed for the kernel, no float32 copy
    is made, and the logits are the float32 product rounded to bf16 (as ``linear`` on the copy)."""
    ops = _cpu_layer_ops()
    if not getattr(ops, "f32_gemm", False):
        pytest.skip("this CPU has no AVX2 and FMA: no float32 kernel of ours")
    model = _tiny_tied_bf16_model()
    model.pack_gemm_weights(ops, float32_kernel=True)
    model.set_matmul_dtype(torch.float32)
    assert model.pack_weights(16)
    assert model.tied_lm_head_gemm.dtype == torch.bfloat16 and model.tied_lm_head_packed is None
    assert model.embed_tokens_matmul_weight is None
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.shape == (5, 640) and logits.dtype == torch.bfloat16
    assert torch.equal(logits, ops.gemm_linear(hidden, model.tied_lm_head_gemm))  # the head's route
    want = (hidden.double() @ model.embed_tokens.weight.double().T).to(torch.bfloat16)
    # fp32 sums of exact products, rounded once: at most one bf16 step from the exact product's rounding
    assert ((logits.double() - want.double()).abs() <= 2 ** -7 * want.double().abs() + 1e-6).all()


def test_tied_lm_head_of_a_float32_model_on_the_float32_kernel():
    """A float32 model with a tied LM head where our float32 GEMMs run (AVX2 and FMA): the head
    multiplies the embedding table packed for that kernel, as an untied head's weight is, so greedy
    rows take their argmax inside it (the logits never written: 1.11-1.24x oneDNN's GEMM plus the
    argmax at 8-256 rows on Zen 5) and a row's logits do not depend on the step's other rows."""
    ops = _cpu_layer_ops()
    if not getattr(ops, "f32_gemm", False):
        pytest.skip("this CPU has no AVX2 and FMA: no float32 kernel of ours")
    model = _tiny_tied_bf16_model().float()
    assert model.pack_weights(16, gemm_ops=ops)
    assert model.tied_lm_head_gemm.dtype == torch.float32 and model.tied_lm_head_packed is None
    hidden = torch.randn(5, 64)
    logits = model.compute_logits(hidden)
    assert logits.shape == (5, 640) and logits.dtype == torch.float32
    assert torch.equal(logits, ops.gemm_linear(hidden, model.tied_lm_head_gemm))  # the head's route
    assert torch.equal(model.compute_logits(hidden[3:4]), logits[3:4])  # the same bits alone
    for vocab in (640, 600):
        assert torch.equal(model.greedy_tokens(hidden, vocab), ops.argmax(logits[:, :vocab].contiguous()))
    want = hidden.double() @ model.embed_tokens.weight.double().T
    torch.testing.assert_close(logits.double(), want, rtol=1e-5, atol=1e-5)


def test_tied_lm_head_on_the_bf16_kernel():
    """A bf16 model on a CPU with AVX512-BF16 or AMX: the tied LM head multiplies the embedding
    table packed for our bf16 GEMM, as the decoder layers do (as fast as oneDNN's, and not held up
    by a preempted thread), and greedy rows take their argmax inside that GEMM."""
    ops = _cpu_layer_ops()
    if not getattr(ops, "bf16_gemm", False):
        pytest.skip("this CPU has neither AVX512-BF16 nor AMX-BF16: no bf16 GEMM of ours")
    model = _tiny_tied_bf16_model()
    assert model.pack_weights(16, gemm_ops=ops)
    hidden = torch.randn(5, 64).to(torch.bfloat16)
    logits = model.compute_logits(hidden)
    assert logits.shape == (5, 640) and logits.dtype == torch.bfloat16
    assert model.tied_lm_head_gemm.dtype == torch.bfloat16 and model.tied_lm_head_packed is None
    assert torch.equal(logits, ops.gemm_linear(hidden, model.tied_lm_head_gemm))  # the head's route
    for vocab in (640, 600):
        assert torch.equal(model.greedy_tokens(hidden, vocab), ops.argmax(logits[:, :vocab].contiguous()))
    want = (hidden.double() @ model.embed_tokens.weight.double().T).to(torch.bfloat16)
    assert ((logits.double() - want.double()).abs() <= 2 ** -7 * want.double().abs() + 1e-6).all()
