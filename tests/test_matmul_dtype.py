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
        assert runner.model.layers[0].mlp.down_proj.weight.dtype == getattr(torch, md)
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
