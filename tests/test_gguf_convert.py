"""The one-pass GGUF converter on small GGUF files of each architecture it takes, written here with
the ``gguf`` package the way llama.cpp writes them, against transformers' own GGUF load."""
from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file
from transformers.convert_slow_tokenizer import bytes_to_unicode

from engine_service import gguf_convert
from engine_service.gguf_convert import convert_gguf

HIDDEN, HEAD_DIM, INTERMEDIATE, LAYERS = 256, 128, 320, 2
# (attention heads, KV heads): llama's and qwen3's heads are wider than hidden / heads, so the head
# size must come from the file (Qwen2's config has no head size of its own).
HEADS = {"llama": (4, 2), "qwen2": (2, 1), "qwen3": (4, 2), "phi3": (2, 1)}
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "Ġ w"]
SPECIALS = ["<|endoftext|>", "<|im_start|>"]
# How each weight is stored: unquantized ones must come back exactly, quantized ones as transformers reads them.
STORAGE = {"attn_q": Q.F32, "attn_k": Q.F32, "attn_v": Q.Q4_1, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_1,
           "ffn_up": Q.F16, "ffn_down": Q.Q8_0, "token_embd": Q.Q8_0, "output": Q.BF16}
HF_TOP_LEVEL_NAMES = {v: k for k, v in gguf_convert._TOP_LEVEL_NAMES.items()}
HF_LAYER_NAMES = {v: k for k, v in gguf_convert._LAYER_NAMES.items()}


def _tokens() -> list[str]:
    tokens = list(bytes_to_unicode().values())
    tokens += ["".join(merge.split()) for merge in MERGES]
    return tokens + SPECIALS


def _hf_weights(architecture: str, vocab: int, tied: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    def w(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.05

    heads, kv_heads = HEADS[architecture]
    q_size, kv_size = heads * HEAD_DIM, kv_heads * HEAD_DIM
    weights = {"model.embed_tokens.weight": w(vocab, HIDDEN), "model.norm.weight": 1 + w(HIDDEN)}
    if not tied:
        weights["lm_head.weight"] = w(vocab, HIDDEN)
    for i in range(LAYERS):
        layer = {
            "input_layernorm.weight": 1 + w(HIDDEN), "post_attention_layernorm.weight": 1 + w(HIDDEN),
            "self_attn.q_proj.weight": w(q_size, HIDDEN), "self_attn.k_proj.weight": w(kv_size, HIDDEN),
            "self_attn.v_proj.weight": w(kv_size, HIDDEN), "self_attn.o_proj.weight": w(HIDDEN, q_size),
            "mlp.gate_proj.weight": w(INTERMEDIATE, HIDDEN), "mlp.up_proj.weight": w(INTERMEDIATE, HIDDEN),
            "mlp.down_proj.weight": w(HIDDEN, INTERMEDIATE),
        }
        if architecture == "qwen2":
            layer |= {f"self_attn.{p}_proj.bias": w(n) for p, n in (("q", q_size), ("k", kv_size), ("v", kv_size))}
        if architecture == "qwen3":
            layer |= {"self_attn.q_norm.weight": 1 + w(HEAD_DIM), "self_attn.k_norm.weight": 1 + w(HEAD_DIM)}
        weights |= {f"model.layers.{i}.{name}": value for name, value in layer.items()}
    return weights


def _gguf_name(hf_name: str) -> str:
    base, _, kind = hf_name.rpartition(".")
    if base in HF_TOP_LEVEL_NAMES:
        return f"{HF_TOP_LEVEL_NAMES[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{HF_LAYER_NAMES[rest]}.{kind}"


def _storage(gguf_name: str, ndim: int) -> Q:
    """How the weight is stored in the test files (vectors always as F32)."""
    return STORAGE.get(gguf_name.split(".")[-2], Q.F32) if ndim == 2 else Q.F32


def _permute_like_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(path: str, architecture: str, weights: dict[str, np.ndarray], tokens: list[str]) -> None:
    heads, kv_heads = HEADS[architecture]
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(HEAD_DIM)
    if architecture == "qwen3":
        writer.add_key_length(HEAD_DIM)
        writer.add_value_length(HEAD_DIM)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 2)
    for hf_name, value in weights.items():
        name = _gguf_name(hf_name)
        if architecture == "llama" and (".attn_q." in name or ".attn_k." in name):
            value = _permute_like_llama_cpp(value, heads if ".attn_q." in name else kv_heads)
        storage = _storage(name, value.ndim)
        if storage == Q.F32:
            writer.add_tensor(name, value)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, storage), raw_dtype=storage)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("architecture,tied", [("llama", True), ("qwen2", False), ("qwen3", True)])
def test_conversion_matches_transformers_gguf_load(tmp_path, architecture, tied):
    tokens = _tokens()
    original = _hf_weights(architecture, len(tokens), tied, np.random.default_rng(7))
    path = str(tmp_path / "tiny.gguf")
    write_gguf(path, architecture, original, tokens)
    out_dir = tmp_path / "converted"
    out_dir.mkdir()
    convert_gguf(path, str(out_dir))

    ours = load_file(str(out_dir / "model.safetensors"))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    reference = ref_model.state_dict()
    assert ours.keys() == original.keys()
    assert ours.keys() == reference.keys() - ({"lm_head.weight"} if tied else set())
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.equal(tensor, reference[name]), name  # bitwise what transformers' own load gives
        stored = _storage(_gguf_name(name), tensor.ndim)
        expected = torch.from_numpy(original[name])
        if stored == Q.F32:  # q/k included: llama.cpp's rotary row order undone exactly
            assert torch.equal(tensor, expected), name
        elif stored == Q.F16:
            assert torch.equal(tensor, expected.half().float()), name
        else:
            assert torch.allclose(tensor, expected, atol=0.02), name

    config = transformers.AutoConfig.from_pretrained(str(out_dir))
    assert config.model_type == architecture and config.architectures == [gguf_convert.SUPPORTED_ARCHITECTURES[architecture][1]]
    heads, kv_heads = HEADS[architecture]
    assert (getattr(config, "head_dim", None) or HIDDEN // heads) == HEAD_DIM
    expected_fields = dict(hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, vocab_size=len(tokens),
                           max_position_embeddings=512, tie_word_embeddings=tied, bos_token_id=len(tokens) - 1,
                           eos_token_id=len(tokens) - 2)
    assert {k: getattr(config, k) for k in expected_fields} == expected_fields
    assert config.rope_parameters["rope_theta"] == 50000.0 and config.rms_norm_eps == pytest.approx(1e-6)
    with open(out_dir / "generation_config.json") as f:
        assert json.load(f)["eos_token_id"] == len(tokens) - 2
    # The converted directory loads as an ordinary checkpoint and computes what transformers' GGUF load does.
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    assert torch.equal(model(ids).logits, ref_model(ids).logits)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out_dir))
    ref_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tiny.gguf")
    text = "hello the world<|im_start|> tell"
    assert tokenizer.encode(text) == ref_tokenizer.encode(text)
    assert tokenizer.tokenize(" the") == ["Ġthe"]
    assert tokenizer.model_max_length == 512


def test_unsupported_architecture_and_tensors_are_named(tmp_path):
    tokens = _tokens()
    path = str(tmp_path / "phi.gguf")
    write_gguf(path, "phi3", {"model.norm.weight": np.ones(HIDDEN, np.float32)}, tokens)
    with pytest.raises(ValueError, match=r"GGUF architecture 'phi3' is not supported; supported: llama, qwen2, qwen3"):
        convert_gguf(path, str(tmp_path))
    with pytest.raises(ValueError, match="'blk.0.ssm_conv1d.weight' has no Hugging Face counterpart"):
        gguf_convert.hf_tensor_name("blk.0.ssm_conv1d.weight")
    assert gguf_convert.hf_tensor_name("rope_freqs.weight") is None
    assert gguf_convert.hf_tensor_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    version_1 = tmp_path / "old.gguf"
    version_1.write_bytes(b"GGUF" + (1).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 1 is not supported"):
        convert_gguf(str(version_1), str(tmp_path))
    assert not os.path.exists(tmp_path / "model.safetensors")


def test_truncated_files_raise_value_errors_naming_the_damage(tmp_path):
    tokens = _tokens()
    path = tmp_path / "tiny.gguf"
    write_gguf(str(path), "llama", _hf_weights("llama", len(tokens), True, np.random.default_rng(1)), tokens)
    data = path.read_bytes()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cut_in_data = tmp_path / "cut_in_data.gguf"
    cut_in_data.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ValueError, match=r"GGUF tensor '.+' runs past the end of the file .* truncated"):
        convert_gguf(str(cut_in_data), str(out_dir))
    cut_in_header = tmp_path / "cut_in_header.gguf"
    cut_in_header.write_bytes(data[:2000])  # inside the vocabulary
    with pytest.raises(ValueError, match="GGUF header is truncated or corrupt at byte"):
        convert_gguf(str(cut_in_header), str(out_dir))
    assert not os.listdir(out_dir)
