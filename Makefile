# megatron-ppo — the commands a user runs. `make test` is what CI runs (see .ci/run).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: setup test lint validate bench train compare-kl drill plan submit report gpu-check

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
	$(VENV)/bin/ruff check megatron_ppo tests bench slurm
	$(VENV)/bin/ruff format --check megatron_ppo tests bench slurm

RECIPE ?= recipes/tiny-cpu.yaml
NPROC  ?= 2

# The main job: the tiny recipe end to end on CPU (data, SFT, offline PPO, evaluation table).
train: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node $(NPROC) --master_port 29650 -m megatron_ppo train $(RECIPE) $(OVERRIDES)

# The tiny recipe with the KL term off, fixed, adaptive and staged: one table side by side.
compare-kl: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node $(NPROC) --master_port 29651 -m megatron_ppo compare-kl $(RECIPE) $(OVERRIDES)

# The fault drill: the tiny recipe with a NaN gradient, a gradient spike, an out-of-memory error, a KL blow-up and an
# evaluation drop injected (test-only patches, tests/drill); prints where each guard fired. A new folder per drill.
DRILL_STAMP := $(shell date -u +%Y%m%d-%H%M%S)
DRILL_DIR ?= outputs/drill/$(DRILL_STAMP)
drill: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node $(NPROC) --master_port 29652 -m tests.drill $(RECIPE) trainer.default_local_dir=$(DRILL_DIR)/checkpoints trainer.log_dir=$(DRILL_DIR)/tensorboard $(OVERRIDES)

# Layout check, per-GPU memory and step-time estimate before any job (exit 1 when it does not fit).
plan: setup
	$(PY) -m megatron_ppo plan $(RECIPE) $(if $(NODES),--nodes $(NODES)) $(OVERRIDES)

# sbatch on the cluster, sized from the recipe's cluster section:
#   make submit RECIPE=... [NODES=4] [CHAIN=3] [DRY_RUN=1] [LOG_DIR=logs] [OVERRIDES="key=value ..."]
submit: setup
	$(PY) slurm/submit.py $(RECIPE) $(if $(NODES),--nodes $(NODES)) $(if $(CHAIN),--chain $(CHAIN)) $(if $(DRY_RUN),--dry-run) $(if $(LOG_DIR),--log-dir $(LOG_DIR)) $(OVERRIDES)

# A run's metrics (first/last/min/max) and guard/checkpoint events from its TensorBoard files.
report: setup
	$(PY) -m megatron_ppo report $(RECIPE) $(OVERRIDES)

validate: setup
	$(PY) -m megatron_ppo validate $(RECIPE) $(OVERRIDES)

# Benchmarks print ratios measured side by side in one run (not timed tests).
bench: setup
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 2 --master_port 29655 -m bench.bench_logprobs
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 1 --master_port 29656 -m bench.bench_actor_step
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 2 --master_port 29657 -m bench.bench_ppo_step
	OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --nproc_per_node 1 --master_port 29658 -m bench.bench_logprob_chunks

# The GPU check (one CUDA GPU, no network, ~8 min on an H100/H200): the tiny recipe on CUDA, a 1.5B-shaped PPO
# iteration (tokens/s, MFU, peak memory against the planner), GPU bf16 against CPU fp32 log-probs; one table and
# outputs/gpu_check.json. `make gpu-check DRY_RUN=1` runs it on the CPU with a tiny model (CI does).
# Works without `make setup` on a bare machine: wheels in .whl/ (../shared/gpu/fetch-wheels.sh .whl) are installed
# once into .whl/site and put on PYTHONPATH with the source tree (see NOTES-gpu.md).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d .whl/site ]; then \
		$(GPU_PY) -m pip install -q --no-index --no-deps --target .whl/site .whl/*.whl; fi
	PYTHONPATH=$(CURDIR):$(CURDIR)/.whl/site$(if $(PYTHONPATH),:$(PYTHONPATH)) OMP_NUM_THREADS=$(or $(OMP_NUM_THREADS),8) \
		$(GPU_PY) -m bench.gpu_check $(if $(DRY_RUN),--dry-run) $(ARGS)
