"""The engine's glibc malloc settings: large activations come from the heap, not fresh mmaps."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = r"""
import ctypes, ctypes.util, sys
import torch
from engine_service import cpu_malloc

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2

def mmapped_during_alloc():
    t = torch.empty(16 << 20, dtype=torch.uint8)  # 16 MiB: above glibc's default mmap threshold
    n = libc.mallinfo2().hblkhd
    del t
    return n - libc.mallinfo2().hblkhd

before = mmapped_during_alloc()
assert cpu_malloc.tune_for_engine()
after = mmapped_during_alloc()
print(before, after)
assert before >= 16 << 20, before       # untuned: the tensor was its own mmap
assert after == 0, after                # tuned: it came from the heap
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_tuned_malloc_serves_large_tensors_from_the_heap():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33")
    # A fresh interpreter: the engine tests in this process may have tuned malloc already.
    res = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_opt_out_leaves_malloc_alone():
    code = ("import os; os.environ['PAGODA_KEEP_MALLOC'] = '1'\n"
            "from engine_service import cpu_malloc; assert cpu_malloc.tune_for_engine() is False")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr



PREFAULT_PROBE = """
import re, sys
from pathlib import Path
from engine_service import LLM
llm = LLM(sys.argv[1], dtype="float32", max_model_len=256, kv_cache_memory_bytes=256 << 20,
          kv_cache_prefault=sys.argv[2] == "1")
cache = llm.llm_engine.runner.kv_cache
start, end = cache.data_ptr(), cache.data_ptr() + cache.numel() * cache.element_size()
kb = 0
for block in re.split(r"\\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
    lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
    if lo < end and start < hi:
        kb += int(re.search(r"\\nRss:\\s+(\\d+) kB", block).group(1))
print(kb, (end - start) >> 10)
"""


def test_kv_cache_is_prefaulted_unless_asked_not_to(tiny_llama_dir):
    """kv_cache_prefault (default): the whole KV cache is resident once the engine is up; off, its
    pages are left untouched until steps write them. A fresh process, so the cache is a fresh mapping."""
    for prefault in ("1", "0"):
        out = subprocess.run([sys.executable, "-c", PREFAULT_PROBE, tiny_llama_dir, prefault], capture_output=True,
                             text=True, check=True).stdout.split()
        resident_kb, size_kb = int(out[-2]), int(out[-1])
        if prefault == "1":
            assert resident_kb >= size_kb
        else:
            assert resident_kb < size_kb // 4


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="ascii") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _vm_flags_of(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="ascii") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return []


def test_kv_cache_memory_is_advised_for_huge_pages():
    """advise_huge_pages marks the tensor's 2 MiB-aligned memory MADV_HUGEPAGE (the mapping's VmFlags
    show 'hg') wherever transparent huge pages are not switched off, and reports False where they are."""
    import torch

    from engine_service import cpu_malloc

    mode = _thp_mode()
    t = torch.empty(16 << 20, dtype=torch.uint8)
    advised = cpu_malloc.advise_huge_pages(t)
    if mode is None or mode == "never":
        assert advised is False
        return
    assert advised is True
    aligned = -(-t.data_ptr() // (2 << 20)) * (2 << 20)
    assert "hg" in _vm_flags_of(aligned)
    assert cpu_malloc.advise_huge_pages(torch.empty(1024, dtype=torch.uint8)) is False  # no whole 2 MiB page


def test_engine_kv_cache_is_advised_for_huge_pages():
    """The model runner advises its pre-faulted KV cache (CPU)."""
    from engine_service import LLM

    llm = LLM(model="bundled", dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=512, max_num_seqs=4)
    runner = llm.llm_engine.runner
    assert runner.kv_cache_huge_pages == (_thp_mode() not in (None, "never"))


TORCH_THP_PROBE = r"""
import os
import engine_service  # first: before torch allocates anything
import torch
from tests.test_cpu_malloc import _vm_flags_of

t = torch.ones(16 << 20, dtype=torch.uint8)  # >= 2 MiB: torch advises it when asked to
print(os.environ["THP_MEM_ALLOC_ENABLE"], "hg" in _vm_flags_of(t.data_ptr() + (8 << 20)))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/smaps")
def test_importing_the_engine_has_torch_advise_large_buffers_for_huge_pages():
    """``import engine_service`` sets THP_MEM_ALLOC_ENABLE=1 before torch's first allocation, so torch
    marks its large CPU buffers MADV_HUGEPAGE ('hg' in the mapping's VmFlags); a value the user set
    already wins (0: no advice)."""
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    default = subprocess.run([sys.executable, "-c", TORCH_THP_PROBE], capture_output=True, text=True, env=env,
                             cwd=ROOT)
    assert default.returncode == 0, default.stderr
    assert default.stdout.split() == ["1", "True"]
    off = subprocess.run([sys.executable, "-c", TORCH_THP_PROBE], capture_output=True, text=True,
                         env={**env, "THP_MEM_ALLOC_ENABLE": "0"}, cwd=ROOT)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["0", "False"]
