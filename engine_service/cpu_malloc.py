"""glibc malloc settings for an engine that runs its model on the CPU.

torch's CPU tensors come from glibc ``malloc``. Above its mmap threshold (128 KiB, adapting up to
32 MiB) every allocation is a fresh ``mmap``: each activation of a step (a [2048, 3072] gate/up
output is 12 MiB) is then page-faulted in, zeroed by the kernel, and unmapped again when freed,
every layer of every step. Raising the threshold to its maximum and never trimming the heap keeps
freed activations mapped for the next layer instead, which is what the tcmalloc that vLLM's CPU
backend preloads achieves. Measured on 8 mixed prefill+decode steps of the shared workload (bf16,
2 cores): 19.7 s -> 16.5 s; ``aten::cat`` 253 -> 35 ms, ``copy_`` 683 -> 81 ms, the GEMMs 9.7 -> 9.0 s.

The cost: memory freed by the engine stays in the process (up to the largest step's working set).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_applied = False


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def tune_for_engine() -> bool:
    """Apply the settings once per process (glibc only; elsewhere, or with
    ``PAGODA_KEEP_MALLOC=1``, nothing is changed). Returns whether they are in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get("PAGODA_KEEP_MALLOC") == "1":
        return False
    try:
        mallopt = _libc().mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): its allocator is left alone
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1 for param, value in
             ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    _applied = ok
    if ok:
        logger.info("glibc malloc tuned for CPU inference: mmap threshold %d MiB, heap kept (trim threshold %d MiB)",
                    MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    return ok


THP_ENV = "THP_MEM_ALLOC_ENABLE"  # read by torch's CPU allocator (c10/core/alloc_cpu.cpp)


def enable_torch_huge_pages() -> bool:
    """Have torch's CPU allocator ask for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on
    every buffer of 2 MiB or more: the step's activations (a [2048, 1536] bf16 gate/up output is
    6 MiB) then fault in 2 MiB at a time and take fewer TLB misses. torch reads the variable once,
    at its first CPU allocation, so this must run before that: ``engine_service`` calls it on
    import, before anything imports torch. A value already set (``THP_MEM_ALLOC_ENABLE=0``) wins.

    Measured on the shared bf16 workload (2-core Xeon with AMX, alternating runs): the run's minor
    page faults 118-138k -> 14-19k, output tok/s +0.8 to +2.3% (bench/RESULTS.md, eighteenth
    session). Returns whether the variable now asks for it (torch follows it only if this ran
    before its first allocation)."""
    return os.environ.setdefault(THP_ENV, "1") == "1"


MADV_HUGEPAGE = 14  # madvise(2)
_HUGE_PAGE = 2 << 20


def advise_huge_pages(tensor) -> bool:
    """Ask Linux to back ``tensor``'s memory (the 2 MiB-aligned part of it) with transparent huge
    pages, before its first touch. For the KV cache: decode attention reads each sequence's blocks
    at scattered places, a TLB miss per 4 KiB page otherwise. Does nothing (False) off Linux/glibc
    or where THP is disabled ("never" in /sys/kernel/mm/transparent_hugepage/enabled)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            if "[never]" in f.read():
                return False
        madvise = _libc().madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    lo, hi = -(-start // _HUGE_PAGE) * _HUGE_PAGE, end // _HUGE_PAGE * _HUGE_PAGE
    if hi <= lo:
        return False
    return madvise(lo, hi - lo, MADV_HUGEPAGE) == 0
