"""CPU paged attention: C++ kernels that read K/V straight through the block tables, for decode and
for prefill / chunked prefill. (The same extension carries the layer's fused elementwise ops:
``layer_ops.py``.)

``TorchAttention.decode`` gathers every sequence's K/V into a dense tensor first, which triples
the memory traffic of a memory-bound op (read, write, read again). The decode kernel in
``csrc/paged_attention_cpu.cpp`` walks the block table instead and attends block by block with an
online softmax, parallel over (sequence, kv head[, context split]) with OpenMP.
``TorchAttention.prefill`` runs one SDPA call per prefilling sequence from Python (gathering a later
chunk's context and building a mask first); the prefill kernel takes all of a step's chunks in one
call, parallel over (sequence, kv head, query tile), with the GQA group's q heads sharing every K/V
tile (AVX-512: fp32, and bf16 with AVX512_BF16; AVX2 + FMA: fp32 and bf16, computed in fp32;
other dtypes and CPUs use the torch path).

The extension is compiled at first use with ``torch.utils.cpp_extension.load`` (needs ``ninja``
and a C++ compiler; a few seconds) into ``$PAGODA_CACHE_DIR/torch_extensions`` (default
``~/.cache/pagoda``), in a directory keyed by the host CPU's features since it is built with
``-march=native`` (or ``-march=$PAGODA_CPU_MARCH``, to test another CPU's paths here). Later processes
reuse the build.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch

from .attention import CODED_CACHE_DTYPES, AttentionMetadata, TorchAttention

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = [_CSRC / "paged_attention_cpu.cpp", _CSRC / "cpu_ops.cpp"]
_NAME = "pagoda_cpu_kernels"
# -ffp-contract=off: cpu_ops.cpp reproduces torch's separately rounded multiplies and adds.
# PAGODA_CPU_MARCH builds for a lesser instruction set than the host's (haswell: AVX2 + FMA without
# AVX-512; x86-64-v2: neither), so one machine can run the paths every other CPU takes.
_MARCH = os.environ.get("PAGODA_CPU_MARCH") or "native"
_CFLAGS = ["-O3", f"-march={_MARCH}", "-fopenmp", "-std=c++17", "-ffp-contract=off"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_op = None  # torch.ops.pagoda_cpu.paged_decode_attention once loaded
_prefill_op = None  # torch.ops.pagoda_cpu.paged_prefill_attention
_prefill_dtypes: dict[torch.dtype, bool] = {}
_NO_INTS = torch.empty(0, dtype=torch.int32)


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


# The instruction-set flags the kernels' code paths depend on: gcc's macro -> /proc/cpuinfo's name.
_ISA_MACROS = {"__AVX2__": "avx2", "__FMA__": "fma", "__AVX512F__": "avx512f", "__AVX512BF16__": "avx512_bf16",
               "__AMX_TILE__": "amx_tile", "__AMX_BF16__": "amx_bf16"}


def build_cpu_flags() -> frozenset[str]:
    """The CPU flags (``/proc/cpuinfo``'s names, of those in ``_ISA_MACROS``) the extension is built
    to use: the host's, or under ``PAGODA_CPU_MARCH`` those of that ``-march`` the host also has."""
    try:
        with open("/proc/cpuinfo") as f:
            host = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        host = []
    wanted = set(_ISA_MACROS.values()) & set(host)
    if _MARCH == "native":
        return frozenset(wanted)
    defined = _march_macros()
    return frozenset(name for macro, name in _ISA_MACROS.items() if macro in defined and name in wanted)


@functools.cache
def _march_macros() -> frozenset[str]:
    """The macros g++ defines for ``-march=$PAGODA_CPU_MARCH``; ValueError where it knows no such target."""
    import subprocess

    run = subprocess.run(["g++", f"-march={_MARCH}", "-dM", "-E", "-x", "c++", "/dev/null"],
                         capture_output=True, text=True)
    if run.returncode:
        raise ValueError(f"PAGODA_CPU_MARCH={_MARCH!r}: g++ does not know this -march target "
                         f"(haswell and x86-64-v2 are the lesser targets the tests use): {run.stderr.strip()[:200]}")
    return frozenset(line.split()[1] for line in run.stdout.splitlines() if line.startswith("#define "))


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

            if _MARCH != "native":
                _march_macros()  # a clear error for a -march g++ does not know, before a build fails

            _ensure_ninja_on_path()
            build_dir = _cache_root() / "torch_extensions" / f"{_NAME}-{_host_tag()}"
            build_dir.mkdir(parents=True, exist_ok=True)
            load(name=_NAME, sources=[str(p) for p in _SOURCES], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                 build_directory=str(build_dir), is_python_module=False, verbose=verbose)
        global _prefill_op
        _prefill_op = torch.ops.pagoda_cpu.paged_prefill_attention.default
        _op = torch.ops.pagoda_cpu.paged_decode_attention.default
        return _op


def _int32(t: torch.Tensor, contiguous: bool = True) -> torch.Tensor:
    """``t`` as the kernels take it: int32, and contiguous for the lengths and offsets (a block
    table's rows may be strided: ``contiguous=False``)."""
    if t.dtype != torch.int32:
        t = t.to(torch.int32)
    return t.contiguous() if contiguous else t


def paged_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode attention, one query token per sequence, K/V read through the block tables.

    q [B, H, D] contiguous; key_cache / value_cache [num_blocks, block_size, kv_heads, D] (head_dim
    contiguous); block_tables [B, max_blocks] int32; seq_lens [B] int32, the context length including
    the current token (whose K/V is already in the cache). H must be a multiple of kv_heads; D a
    multiple of 16; float32, bfloat16 or float16, or float8_e5m2 / float8_e4m3fn caches (one byte a
    value) with bfloat16 or float32 q where ``decode_supports_f8(q.dtype)``; subnormal values read as zero where
    ``decode_f8_flushes_subnormals(q.dtype)``, else every code as its value), or int8 caches [num_blocks,
    block_size, kv_heads, D + 4] (each row D codes and a float32 scale, ``quantize_int8_rows``) with
    bfloat16 or float32 q where ``decode_supports_int8(q.dtype)``. Returns [B, H, D] in q's dtype
    (``out`` if given). Accumulation is in float32. A sequence of length 0 gets zeros.
    """
    op = _op if _op is not None else load_extension()
    block_tables, seq_lens = _int32(block_tables, contiguous=False), _int32(seq_lens)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    op(q, key_cache, value_cache, block_tables, seq_lens, float(scale), out, torch.get_num_threads())
    return out


def decode_supports_f8(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this host's build of the decode and prefill kernels reads one-byte caches
    (float8_e5m2, float8_e4m3fn) with queries of ``dtype``: bf16 on a CPU with AVX512-BF16 or in a
    build for AVX2 + FMA + F16C; float32 in builds for AVX-512 and AVX2, which widen the codes to
    float32."""
    load_extension()
    return bool(torch.ops.pagoda_cpu.decode_supports_f8(dtype))


def decode_f8_flushes_subnormals(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this build reads subnormal one-byte codes as zero with queries of ``dtype`` (bf16 on
    the AVX512-BF16 kernels, whose dot products treat subnormal inputs so) rather than as their
    values (float32 queries, and every AVX2 build)."""
    load_extension()
    return bool(torch.ops.pagoda_cpu.decode_f8_flushes_subnormals(dtype))


def decode_supports_int8(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this host's build of the decode and prefill kernels reads an int8 cache (each row
    head_dim codes and a float32 scale, ``pagoda_kernels.attention.quantize_int8_rows``) with
    queries of ``dtype``: where it reads one-byte caches (``decode_supports_f8``)."""
    load_extension()
    return bool(torch.ops.pagoda_cpu.decode_supports_int8(dtype))


def prefill_supported(dtype: torch.dtype) -> bool:
    """Whether this host's build has the C++ prefill kernel for ``dtype`` (fp32 with AVX-512 or
    AVX2, bf16 with AVX512_BF16 or AVX2)."""
    ok = _prefill_dtypes.get(dtype)
    if ok is None:
        load_extension()
        ok = _prefill_dtypes[dtype] = bool(torch.ops.pagoda_cpu.prefill_supports(dtype))
    return ok


def paged_prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill / chunked-prefill attention for a step's chunks, K/V read through the block tables.

    q [T, H, D] (head_dim contiguous): the chunks' queries back to back, sequence i's at rows
    query_start_loc[i] .. query_start_loc[i + 1]; seq_lens [B]: each sequence's length after its
    chunk. Query j of a chunk of length L sees keys 0 .. seq_len - L + j (bottom-right-aligned
    causal), all read from the cache, so the chunk's own K/V must have been written first.
    block_tables [B, max_blocks] int32; query_start_loc [B + 1] and seq_lens int32. Returns [T, H, D]
    in q's dtype (``out`` if given). See ``prefill_supported`` for the dtypes.
    """
    if _prefill_op is None:
        load_extension()
    block_tables = _int32(block_tables, contiguous=False)
    query_start_loc, seq_lens = _int32(query_start_loc), _int32(seq_lens)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _prefill_op(q, key_cache, value_cache, block_tables, query_start_loc, seq_lens, float(scale), out,
                torch.get_num_threads())
    return out


class CpuAttention(TorchAttention):
    """TorchAttention with decode() and prefill() on the C++ paged kernels (prefill falls back to the
    torch path for dtypes the kernel does not cover)."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__("cpu")
        load_extension()  # build now (seconds, once per host) rather than inside the first step
        self._reshape_and_cache = torch.ops.pagoda_cpu.reshape_and_cache.default

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """reshape_and_cache in one C++ pass (a row copy per token); torch's index_copy_ for layouts
        the kernel does not take."""
        if (key.stride(-1) == 1 and value.stride(-1) == 1 and key.stride(1) == key.shape[2]
                and value.stride(1) == value.shape[2] and key_cache.is_contiguous() and value_cache.is_contiguous()
                and slot_mapping.dtype == torch.int64 and key.dtype == value.dtype
                and (key_cache.dtype == key.dtype
                     or (key_cache.dtype in CODED_CACHE_DTYPES and key.dtype in (torch.bfloat16, torch.float32)))):
            self._reshape_and_cache(key, value, key_cache, value_cache, slot_mapping.contiguous())
        else:
            super().write_kv(key, value, key_cache, value_cache, slot_mapping)

    def prefill_reads_cache(self, dtype: torch.dtype) -> bool:
        return prefill_supported(dtype)

    def reads_cache_dtype(self, cache_dtype: torch.dtype, dtype: torch.dtype) -> bool:
        # A one-byte or int8 cache with a bf16 or float32 model, where the build's kernels read it.
        supports = decode_supports_int8 if cache_dtype == torch.int8 else decode_supports_f8
        coded = cache_dtype in CODED_CACHE_DTYPES and dtype in (torch.bfloat16, torch.float32) and supports(dtype)
        return coded or super().reads_cache_dtype(cache_dtype, dtype)

    def prefill_rows_independent(self, dtype: torch.dtype) -> bool:
        # The kernel attends each query row over the same key tiles in the same order, whatever the
        # chunk's other rows (tests/test_engine.py); without it (no AVX2) the torch path runs.
        return prefill_supported(dtype)

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """The prefill kernel's int32 query offsets, lengths and tables, once per step (every layer
        reuses them). The torch fallback's own metadata is built only if a layer needs it."""
        cache: dict = {"block_size": block_size}
        if meta.num_prefills:
            query_start = torch.zeros(meta.num_prefills + 1, dtype=torch.int32)
            torch.cumsum(meta.prefill_query_lens, 0, out=query_start[1:])
            cache["prefill_query_start"] = query_start
            cache["prefill_seq_lens"] = meta.prefill_seq_lens.to(torch.int32)
            cache["prefill_block_tables"] = meta.prefill_block_tables.to(torch.int32).contiguous()
        meta.cache = cache

    def kernel_tensors(self, meta: AttentionMetadata, dtype: torch.dtype) -> tuple | None:
        """(decode block tables, decode seq_lens, prefill block tables, prefill query starts,
        prefill seq_lens), int32 as the kernels take them (empty where the step has no prefill);
        None where a prefill needs the torch fallback."""
        c = meta.cache
        if meta.num_prefills:
            if not prefill_supported(dtype):
                return None
            prefill = (c["prefill_block_tables"], c["prefill_query_start"], c["prefill_seq_lens"])
        else:
            prefill = (_NO_INTS, _NO_INTS, _NO_INTS)
        return (_int32(meta.decode_block_tables, contiguous=False), _int32(meta.decode_seq_lens), *prefill)

    def decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
        """q [Bd, H, D] -> [Bd, H, D] (into ``out`` if given, contiguous); one query per sequence."""
        return paged_decode_attention(q, key_cache, value_cache, meta.decode_block_tables,
                                      meta.decode_seq_lens, scale, out=out)

    def prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """q [Tp, H, D], k/v [Tp, kv_heads, D] (already in the cache) -> [Tp, H, D]; one C++ call for
        all of the step's chunks."""
        c = meta.cache
        if prefill_supported(q.dtype):
            return paged_prefill_attention(q, key_cache, value_cache, c["prefill_block_tables"],
                                           c["prefill_query_start"], c["prefill_seq_lens"], scale, out=out)
        if "prefill_chunks" not in c:  # torch fallback (e.g. fp16): its own metadata, once per step
            super().prepare(meta, c["block_size"])
            meta.cache.update(c)
        return super().prefill(q, k, v, key_cache, value_cache, meta, scale, out=out)
