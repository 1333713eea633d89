#!/usr/bin/env bash
# Prepare, on this machine, what bench/gpu_check.sh needs carried to a lent GPU machine:
#   .gpu/like/        the converted bundled model's config, generation config and tokenizer (no weights)
#   .gpu/workload.py  ../shared/bench/workload.py
#   .whl/             wheels that machine's image lacks (structlog; transformers for an image older than 5)
# Both folders are ignored through .git/info/exclude, so they travel only when a call names them:
#   device run: OUT=$OUT bash bench/gpu_check.sh   carry: [".gpu", ".whl"]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
for d in /.gpu/ /.whl/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done
like=$($PY -c "from engine_service.model_loader import resolve_model_dir; print(resolve_model_dir('bundled'))")
mkdir -p .gpu/like .whl
for f in "$like"/*; do
  case $(basename "$f") in
    config.json|generation_config.json|tokenizer*|special_tokens*|chat_template*) cp "$f" .gpu/like/ ;;
  esac
done
cp ../shared/bench/workload.py .gpu/workload.py
version() { $PY -c "import importlib.metadata as m; print(m.version('$1'))"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  "structlog==$(version structlog)" "transformers==$(version transformers)"
du -sh .gpu .whl
