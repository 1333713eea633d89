"""The kernels' paths for CPUs with less than this one has, run here: the kernel tests again in a
child pytest, with the extension built for a lesser ``-march`` (``PAGODA_CPU_MARCH``) and torch's own
kernels and oneDNN's held to the matching width (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``), so
that a torch reference takes the path it takes on such a CPU. An AVX-512 host so checks the AVX2 +
FMA paths (Zen 3's) and the portable ones, an AVX2 host the portable ones; each target is skipped
where it would only repeat the host's own run."""
from __future__ import annotations

import os
import platform
import re
import subprocess
import sysconfig
import sys
from pathlib import Path

import pytest

from pagoda_kernels.cpu_attention import build_cpu_flags

ROOT = Path(__file__).resolve().parent.parent
# The kernels' own tests, and the engine's tests of the C++ layer stack and the LM head's argmax.
KERNEL_TESTS = ["tests/test_layer_ops.py", "tests/test_cpu_attention.py", "tests/test_matmul_dtype.py",
                "tests/test_engine.py::test_decoder_layers_in_one_call_give_the_python_layers_logits",
                "tests/test_engine.py::test_greedy_steps_take_the_argmax_inside_the_lm_head_with_the_same_tokens"]

# (-march, ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, the flags the build then uses, the host flag
# without which it repeats the host, a -k expression over KERNEL_TESTS). Without AVX2 there is
# no GEMM of ours and no fused QKV + rotary, so the bundled model's layer stack takes the tiny
# model's paths (head_dim 64 is in the attention kernels' own tests): its variants, a third of
# that run's time on torch's and oneDNN's portable kernels, are left out.
LESSER = [pytest.param("haswell", "avx2", "AVX2", {"avx2", "fma"}, "avx512f", None, id="avx2-fma"),
          pytest.param("x86-64-v2", "default", "SSE41", set(), "avx2", "not bundled", id="no-avx2")]


def lesser_env(march: str, capability: str, onednn: str) -> dict[str, str]:
    return dict(os.environ, PAGODA_CPU_MARCH=march, ATEN_CPU_CAPABILITY=capability, ONEDNN_MAX_CPU_ISA=onednn)


def start_lesser_builds(marches: set[str]) -> list[subprocess.Popen]:
    """Build the extension for each of ``marches`` this host runs a lesser run of, in the background
    at the lowest priority, so that it takes only the cycles the suite leaves idle (its gRPC and
    Redis waits) and the run finds it built: a build is 20-40 s of compiling on two cores. The run's
    own ``load_extension`` waits on torch's lock in the build directory while a build is under way,
    and builds anew if one failed. The conftest starts these when the runs are selected."""
    if platform.machine() != "x86_64" or os.environ.get("PAGODA_CPU_MARCH"):
        return []  # the runs skip
    host = build_cpu_flags()
    builds = []
    for param in LESSER:
        march, capability, onednn, _, above, _ = param.values
        if march in marches and above in host:
            builds.append(subprocess.Popen(
                [sys.executable, "-c", "import os; os.nice(19)\n"
                 "from pagoda_kernels.cpu_attention import load_extension; load_extension()"],
                env=lesser_env(march, capability, onednn), cwd=ROOT, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, process_group=0))
    return builds


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the lesser -march targets are x86-64's")
@pytest.mark.skipif(bool(os.environ.get("PAGODA_CPU_MARCH")), reason="already under a lesser -march")
@pytest.mark.parametrize("march,capability,onednn,flags,above,select", LESSER)
def test_kernel_tests_pass_built_for_a_lesser_cpu(march, capability, onednn, flags, above, select):
    host = build_cpu_flags()
    if above not in host:
        pytest.skip(f"this CPU has no {above}: its own run already takes the {march} paths")
    env = lesser_env(march, capability, onednn)
    probe = subprocess.run([sys.executable, "-c", "from pagoda_kernels.cpu_attention import build_cpu_flags as f; "
                            "print(' '.join(sorted(f())))"], env=env, cwd=ROOT, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    assert set(probe.stdout.split()) == flags
    keep = ["-k", select] if select else []
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *keep, *KERNEL_TESTS],
                         env=env, cwd=ROOT, capture_output=True, text=True)
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    assert run.returncode == 0, f"the kernel tests failed built for -march={march}:\n{tail}"
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 150, f"too few kernel tests ran for -march={march}:\n{tail}"


def test_an_unknown_march_is_a_clear_error_before_any_build():
    env = dict(os.environ, PAGODA_CPU_MARCH="no-such-cpu")
    run = subprocess.run([sys.executable, "-c", "from pagoda_kernels.cpu_attention import load_extension\n"
                          "try:\n    load_extension()\nexcept ValueError as e:\n    print('ValueError', e)"],
                         env=env, cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ValueError PAGODA_CPU_MARCH='no-such-cpu'"), run.stdout


# -march targets whose paths a host may lack, each with a set of macros it must define (so a
# compiler that quietly drops one is noticed): AMX with AVX512-BF16 and VBMI, AVX512-BF16 without
# VBMI, AVX-512 without BF16, AVX2 + FMA + F16C.
EVERY_BUILD = [pytest.param("sapphirerapids", ["__AMX_BF16__", "__AVX512BF16__", "__AVX512VBMI__"], id="amx"),
               pytest.param("cooperlake", ["__AVX512BF16__"], id="avx512-bf16"),
               pytest.param("skylake-avx512", ["__AVX512F__"], id="avx512-no-bf16"),
               pytest.param("haswell", ["__AVX2__", "__FMA__", "__F16C__"], id="avx2-fma")]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the -march targets are x86-64's")
@pytest.mark.parametrize("march,macros", EVERY_BUILD)
def test_the_kernels_compile_for_every_cpu_they_have_paths_for(march, macros):
    """Every instruction set's build of the kernels compiles, templates instantiated
    (``-fsyntax-only``), on any x86-64 host: a path this host cannot run (AVX-512, AMX on a Zen 2)
    is still checked to build, so a change made and tested on one kind of CPU cannot leave another's
    build broken."""
    from torch.utils.cpp_extension import include_paths

    from pagoda_kernels.cpu_attention import _CSRC, _SOURCES

    defined = subprocess.run(["g++", f"-march={march}", "-dM", "-E", "-x", "c++", "/dev/null"],
                             capture_output=True, text=True, check=True).stdout
    assert all(f"#define {m} 1" in defined for m in macros), f"g++ -march={march} lacks one of {macros}"
    base = ["g++", "-std=c++17", f"-march={march}", "-fopenmp", "-fsyntax-only", f"-I{_CSRC}",
            "-DTORCH_EXTENSION_NAME=pagoda_syntax_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f"-isystem{p}" for p in include_paths()), f"-isystem{sysconfig.get_paths()['include']}"]
    runs = [subprocess.Popen([*base, str(src)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for src in _SOURCES]
    for src, run in zip(_SOURCES, runs):
        out = run.communicate()[0]
        errors = [line for line in out.splitlines() if "error" in line]
        assert run.returncode == 0 and not errors, f"{src.name} does not compile for -march={march}:\n" + \
            "\n".join(errors[:20])
