"""One pass from a GGUF file to a float32 Hugging Face directory, for the architectures Pagoda runs.

transformers reads a GGUF three times to load it (config, model, tokenizer), and maps tensor names
by walking the model's modules: 26-33 s for the bundled 135M model. This reads the file's header
once (the format is a short sequence of length-prefixed values), dequantizes each tensor with the
``gguf`` package (the same function transformers calls, so the weights are bitwise the same), maps
llama.cpp's tensor names with a table, and undoes llama.cpp's rotary permutation of q/k: a few
seconds. The tokenizer is transformers' own GGUF conversion, which reads only the vocabulary.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import transformers
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import save_file

# GGUF metadata value types (the file format's own numbering).
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF architecture -> (HF model_type, model class). Mistral's files say "llama".
SUPPORTED_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
}
# "{arch}.<key>" -> config field; "tokenizer.ggml.<key>" -> config field.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_TOKEN_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id",
                  "padding_token_id": "pad_token_id", "unknown_token_id": "unk_token_id"}
_TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Precomputed rotary frequencies (llama 3 scaling); the model computes its own from the config.
_DERIVED_TENSORS = {"rope_freqs.weight"}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists the innermost dimension first)
    ggml_type: int
    offset: int  # from the start of the file


@dataclass(frozen=True)
class GgufHeader:
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buffer) -> None:
        self.buffer, self.pos = buffer, 0

    def unpack(self, fmt: str):
        value = struct.unpack_from(fmt, self.buffer, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        start, self.pos = self.pos, self.pos + length
        return bytes(self.buffer[start:self.pos]).decode("utf-8", errors="replace")

    def value(self, value_type: int):
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[item_type]).newbyteorder("<")
                items = np.frombuffer(self.buffer, dtype=dtype, count=count, offset=self.pos)
                self.pos += items.nbytes
                return items.tolist()
            return [self.value(item_type) for _ in range(count)]
        if value_type not in _SCALAR_FORMATS:
            raise ValueError(f"unknown GGUF metadata value type {value_type}")
        return self.unpack(_SCALAR_FORMATS[value_type])


def read_header(buffer) -> GgufHeader:
    """Metadata and tensor table of a GGUF file (version 2 or 3) held in ``buffer``."""
    cursor = _Cursor(buffer)
    if bytes(buffer[:4]) != GGUF_MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    cursor.pos = 4
    version = cursor.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
    try:
        num_tensors, num_values = cursor.unpack("<Q"), cursor.unpack("<Q")
        metadata = {}
        for _ in range(num_values):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.unpack("<I"))
        entries = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.unpack("<Q") for _ in range(cursor.unpack("<I"))]
            entries.append((name, tuple(reversed(dims)), cursor.unpack("<I"), cursor.unpack("<Q")))
    except (struct.error, ValueError) as e:  # a length or count read from a cut or damaged file
        raise ValueError(f"GGUF header is truncated or corrupt at byte {cursor.pos}: {e}") from None
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-cursor.pos // alignment) * alignment
    tensors = [TensorInfo(name, shape, ggml_type, data_start + offset) for name, shape, ggml_type, offset in entries]
    return GgufHeader(metadata, tensors)


def gguf_config(header: GgufHeader) -> transformers.PretrainedConfig:
    """The Hugging Face config a GGUF's metadata describes (llama, qwen2 and qwen3 architectures)."""
    metadata = header.metadata
    architecture = metadata.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type, model_class = SUPPORTED_ARCHITECTURES[architecture]
    fields = {field: metadata[f"{architecture}.{key}"] for key, field in _CONFIG_KEYS.items()
              if f"{architecture}.{key}" in metadata}
    fields.update({field: metadata[f"tokenizer.ggml.{key}"] for key, field in _TOKEN_ID_KEYS.items()
                   if f"tokenizer.ggml.{key}" in metadata})
    fields.setdefault("vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())) or None)
    # Qwen3 states its head size; llama's rotary dimension is its head size.
    head_dim = metadata.get(f"{architecture}.attention.key_length")
    if head_dim is None and architecture == "llama":
        head_dim = metadata.get(f"{architecture}.rope.dimension_count")
    if head_dim is not None:
        fields["head_dim"] = head_dim
    names = {info.name for info in header.tensors}
    fields["tie_word_embeddings"] = "output.weight" not in names
    if architecture == "llama":
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
    config = transformers.AutoConfig.for_model(model_type, **{k: v for k, v in fields.items() if v is not None})
    config.architectures = [model_class]
    config.dtype = torch.float32
    return config


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a llama.cpp tensor name; None for tensors HF derives."""
    if gguf_name in _DERIVED_TENSORS:
        return None
    base, _, kind = gguf_name.rpartition(".")
    if base in _TOP_LEVEL_NAMES and kind in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[base]}.{kind}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in a llama-family model")


def _unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (rotary pairs interleaved within each head)."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def read_tensor(buffer, info: TensorInfo) -> torch.Tensor:
    """One tensor of the file, dequantized to a float32 torch tensor of its torch shape."""
    qtype = GGMLQuantizationType(info.ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    row_bytes = info.shape[-1] // block_size * type_size
    rows = int(np.prod(info.shape[:-1], dtype=np.int64))
    if info.offset + rows * row_bytes > len(buffer):
        raise ValueError(f"GGUF tensor {info.name!r} runs past the end of the file ({len(buffer)} bytes): "
                         "the file is truncated")
    raw = np.frombuffer(buffer, dtype=np.uint8, count=rows * row_bytes, offset=info.offset)
    values = dequantize(raw.reshape(*info.shape[:-1], row_bytes), qtype)
    if not values.flags.writeable:  # float32 tensors come back as views of the file
        values = values.copy()
    return torch.from_numpy(values.reshape(info.shape))


def gguf_state_dict(buffer, header: GgufHeader, config) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name, float32, with q/k rows in Hugging Face order."""
    state = {}
    for info in header.tensors:
        name = hf_tensor_name(info.name)
        if name is None:
            continue
        tensor = read_tensor(buffer, info)
        # llama.cpp permutes q/k only for the llama architecture (Qwen's files keep HF's order).
        if config.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            tensor = _unpermute_rotary(tensor, heads)
        state[name] = tensor.contiguous()
    return state


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Write ``gguf_path`` as a float32 Hugging Face directory (config, weights, tokenizer) into ``out_dir``."""
    with open(gguf_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
        header = read_header(buffer)
        config = gguf_config(header)
        state = gguf_state_dict(buffer, header, config)
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        del state
    config.save_pretrained(out_dir)
    transformers.GenerationConfig.from_model_config(config).save_pretrained(out_dir)
    src_dir, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(src_dir, gguf_file=name)
    # GGUF carries no tokenizer length limit; use the model's, as the HF release does.
    tokenizer.model_max_length = config.max_position_embeddings
    # The chat template goes into tokenizer_config.json, where every reader looks for it.
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
