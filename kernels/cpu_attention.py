"""CPU paged decode attention: a C++ kernel that reads K/V straight through the block tables.
(The same extension carries the layer's fused elementwise ops: ``layer_ops.py``.)

``TorchAttention.decode`` gathers every sequence's K/V into a dense tensor first, which triples
the memory traffic of a memory-bound op (read, write, read again). The kernel in
``csrc/paged_attention_cpu.cpp`` walks the block table instead and attends block by block with an
online softmax, parallel over (sequence, kv head[, context split]) with OpenMP.

The extension is compiled at first use with ``torch.utils.cpp_extension.load`` (needs ``ninja``
and a C++ compiler; a few seconds) into ``$PAGODA_CACHE_DIR/torch_extensions`` (default
``~/.cache/pagoda``), in a directory keyed by the host CPU's features since it is built with
``-march=native``. Later processes reuse the build.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from .attention import AttentionMetadata, TorchAttention

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "paged_attention_cpu.cpp", _CSRC / "cpu_ops.cpp"]
_NAME = "pagoda_cpu_kernels"
# -ffp-contract=off: cpu_ops.cpp reproduces torch's separately rounded multiplies and adds.
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_op = None  # torch.ops.pagoda_cpu.paged_decode_attention once loaded


def _cache_root() -> Path:
    root = os.environ.get("PAGODA_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "pagoda"


def _host_tag() -> str:
    """Key of what the build depends on besides the source: CPU features (-march=native), torch,
    python and its environment."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    flags += line
                if line.strip() == "":  # the first processor is enough
                    break
    except OSError:
        flags = platform.processor()
    # sys.prefix: the build files name the venv's include paths, so two venvs sharing one build
    # directory would rebuild each other's extension on every start.
    key = "|".join([flags, torch.__version__, sys.version.split()[0], platform.machine(), " ".join(_CFLAGS),
                    sys.prefix])
    return hashlib.sha1(key.encode()).hexdigest()[:12]


def _ensure_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the pip wheel may sit in an unactivated venv."""
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja  # the pip package

        dirs.insert(0, ninja.BIN_DIR)
    except Exception:
        pass
    path = os.environ.get("PATH", "")
    parts = path.split(os.pathsep) if path else []
    missing = [d for d in dirs if d and d not in parts]
    if missing:
        os.environ["PATH"] = os.pathsep.join(missing + parts)


def load_extension(verbose: bool = False):
    """Build (first time on this host) and load the extension; returns the op. Thread-safe, cached."""
    global _op
    if _op is not None:
        return _op
    with _lock:
        if _op is not None:
            return _op
        if not hasattr(torch.ops.pagoda_cpu, "paged_decode_attention"):
            from torch.utils.cpp_extension import load

            _ensure_ninja_on_path()
            build_dir = _cache_root() / "torch_extensions" / f"{_NAME}-{_host_tag()}"
            build_dir.mkdir(parents=True, exist_ok=True)
            load(name=_NAME, sources=[str(p) for p in _SOURCES], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                 build_directory=str(build_dir), is_python_module=False, verbose=verbose)
        _op = torch.ops.pagoda_cpu.paged_decode_attention.default
        return _op


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence, K/V read through the block tables.

    q [B, H, D] contiguous; key_cache / value_cache [num_blocks, block_size, kv_heads, D] (head_dim
    contiguous); block_tables [B, max_blocks] int32; seq_lens [B] int32, the context length including
    the current token (whose K/V is already in the cache). H must be a multiple of kv_heads; D a
    multiple of 16; float32, bfloat16 or float16. Returns [B, H, D] in q's dtype (``out`` if given).
    Accumulation is in float32. A sequence of length 0 gets zeros.
    """
    op = _op if _op is not None else load_extension()
    if block_tables.dtype != torch.int32:
        block_tables = block_tables.to(torch.int32)
    if seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous():
        seq_lens = seq_lens.to(torch.int32).contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    op(q, key_cache, value_cache, block_tables, seq_lens, float(scale), out, torch.get_num_threads())
    return out


class CpuAttention(TorchAttention):
    """TorchAttention with decode() on the C++ paged kernel; prefill() is inherited (torch ops)."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__("cpu")
        load_extension()  # build now (seconds, once per host) rather than inside the first step

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D]; one query per sequence."""
        return paged_decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                      meta.decode_seq_lens, scale)
