# megatron-ppo — the commands a user runs. `make test` is what CI runs (see .ci/run).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint validate

setup: $(STAMP)

# torch first, pinned: the CPU wheel on disk, so no dependency ever pulls a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -c "import importlib.util, sys; sys.exit('PyPI apex is installed: it breaks megatron-core layer specs; pip uninstall apex' if importlib.util.find_spec('apex') else 0)"
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check megatron_ppo tests
	$(VENV)/bin/ruff format --check megatron_ppo tests

RECIPE ?= recipes/tiny-cpu.yaml
validate: setup
	$(PY) -m megatron_ppo validate $(RECIPE) $(OVERRIDES)
