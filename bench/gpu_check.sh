#!/usr/bin/env bash
# The engine's GPU checks in one call on a lent CUDA machine (bench/gpu_check.py says what each does).
# Run from the repository root there, with what it needs carried beside the tree (bench/gpu_prepare.sh
# makes both folders here):
#   .gpu/like/      config, generation config and tokenizer of the converted bundled model
#   .gpu/workload.py  a copy of ../shared/bench/workload.py
#   .whl/           wheels of packages that machine's image lacks (structlog; transformers if older than 5)
# Logs and the profile land in $OUT. Each stage has its own time limit; a failed stage does not stop the rest.
set -u
OUT=${OUT:-/tmp/pagoda-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PAGODA_WORKLOAD=$PWD/.gpu/workload.py PAGODA_CACHE_DIR=/tmp/pagoda-cache
PY=${PY:-python3}
STAGES=${STAGES:-model identity steps throughput triton_tests}  # a rerun can name fewer
SITE=/tmp/pagoda-site
mkdir -p $SITE
$PY -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/structlog-*.whl
if ! $PY -c "import transformers, sys; sys.exit(int(transformers.__version__.split('.')[0]) < 5)"; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/transformers-*.whl
fi
# The package layout pyproject.toml maps (kernels/ is imported as pagoda_kernels).
ln -sfn "$PWD/kernels" $SITE/pagoda_kernels
ln -sfn "$PWD/protos/pagoda" $SITE/pagoda
export PYTHONPATH=$SITE:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/env.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$OUT/env.txt"
nproc | tee -a "$OUT/env.txt"

stage() {  # stage NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2
  [[ " $STAGES " == *" $name "* ]] || return 0
  local t0=$SECONDS
  echo "=== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -v -E "Loading weights|Writing model|it/s\]|USDT" "$OUT/$name.log" | tail -n 40
  echo "=== $name rc=$rc in $((SECONDS - t0)) s"
}

[ -d /tmp/smol ] && STAGES=${STAGES/model/}  # made by an earlier call on this machine
stage model 120 $PY bench/gpu_check.py model /tmp/smol --like .gpu/like
stage identity 150 $PY bench/gpu_check.py identity /tmp/smol
stage steps ${STEPS_LIMIT:-200} $PY bench/gpu_check.py steps /tmp/smol --out-dir "$OUT"
stage throughput 200 $PY bench/gpu_check.py throughput /tmp/smol --profile-out "$OUT/profile.txt"
stage triton_tests ${TESTS_LIMIT:-150} env TRITON_INTERPRET=0 PAGODA_TEST_MODEL_DIR=/tmp/smol \
  $PY -m pytest -q -p no:cacheprovider --timeout 120 tests/test_triton_attention.py ${PYTEST_ARGS:-}
