# megatron-ppo — the commands a user runs. `make test` is what CI runs (see .ci/run).
# Python 3.12: PYTHON=..., else the first 3.12 found on PATH or in pyenv's versions.
PYTHON ?= $(firstword $(foreach p,python3.12 $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) $(wildcard /usr/bin/python3.12),\
            $(shell $(p) -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null && echo $(p))))
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
LOCK   := requirements/lock.txt
FLOOR  := $(VENV)/floor
PYTEST := $(PY) -m pytest -q --durations=25
# torchrun --standalone: a free port per launch, so two jobs on one machine (two `make train`, or one beside the suite) never collide.
TORCHRUN = OMP_NUM_THREADS=1 $(VENV)/bin/torchrun --standalone
# A training run's launch: the workers under megatron-ppo's own launcher (torchrun's engine), which validates first and
# ends with the workers' one message and exit status (2 a user error, 130 Ctrl-C, 75 preemption, 3 a guard stop).
TRAIN = OMP_NUM_THREADS=1 $(PY) -m megatron_ppo train --nproc $(NPROC)

.PHONY: setup test test-fast test-floor lint docs lock gpu-wheels validate bench bench-data train score figure compare-kl drill faults plan submit report gpu-check profile

setup: $(STAMP)

# torch first, from the lock, so no dependency ever resolves a second torch; then the package and its test, plot and docs extras,
# every version held to the lock.
$(STAMP): pyproject.toml $(LOCK)
	@test -n "$(PYTHON)" || { echo "no Python 3.12 found: make setup PYTHON=/path/to/python3.12" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(LOCK) torch
	$(PY) -m pip install --quiet -c $(LOCK) -e '.[test,plot,docs]'
	$(PY) -c "import importlib.util, sys; sys.exit('PyPI apex is installed: it breaks megatron-core layer specs; pip uninstall apex' if importlib.util.find_spec('apex') else 0)"
	touch $(STAMP)

# The whole suite (what CI runs), the inner loop without e2e and Slurm, and the floor leg: the tests marked `floor`
# against the oldest megatron-core and torch the package admits (requirements/floor.txt, torch's CUDA runtime wheels
# included: ~3 GB), installed beside the main environment, first on PYTHONPATH (nothing else moves); before the tests,
# pip check over both, and each floor.txt pin must be the version Python finds.
# Every tier in one pytest-xdist run on TEST_WORKERS workers of one torch thread each (tests/conftest.py schedules
# it): the tiers whose tests start processes of their own first, the Slurm and end-to-end ones before the
# distributed, a module (or a group of modules sharing a costly session fixture) to a worker; then the one-process
# tier's tests (tests/unit, tests/parity) one by one, on whichever worker is free. Their launches leave the cores
# idle a quarter of the time (one-process phases, imports, rendezvous, checkpoint writes), so 3 workers on 2 cores:
# measured on 2 cores, the suite took 1056 s as two runs (the one-process tier first on 2 workers, then the others
# on 2), 972 s as one run on 2 workers, 929 and 945 s on 3, 1118 s on 4. Again on 2026-12-06 (a larger suite):
# 1056 s on 3 workers, 1291 s on 4; on 3 both cores were busy 99.7 % of the run (/proc/stat): the suite is bound
# by its CPU work, and more workers only contend.
TEST_WORKERS ?= 3
# PYTHONDONTWRITEBYTECODE emptied for the suite: it starts ~300 Python processes that import the package (and the test
# workers import every test module), each compiling its ~115 modules again (0.14 CPU-s) where the environment asks
# Python not to write bytecode (our development machines do); pip compiled the dependencies at install.
ALL_TIERS = PYTHONDONTWRITEBYTECODE= OMP_NUM_THREADS=1 $(PYTEST) -n $(TEST_WORKERS)

test: setup
	$(ALL_TIERS)

test-fast: setup
	$(ALL_TIERS) -m "not e2e and not slurm"

$(FLOOR)/.installed: requirements/floor.txt $(STAMP)
	rm -rf $(FLOOR)
	$(PY) -m pip install --quiet --no-deps --target $(FLOOR) -r requirements/floor.txt
	touch $@

test-floor: $(FLOOR)/.installed
	PYTHONPATH=$(abspath $(FLOOR)) $(PY) -m pip check
	PYTHONPATH=$(abspath $(FLOOR)) $(PY) -c "import importlib.metadata as md, sys; pins = dict(line.split()[0].split('==') for line in open('requirements/floor.txt') if '==' in line and not line.startswith('#')); off = [f'{n} {md.version(n)}, not {v}' for n, v in pins.items() if md.version(n) != v]; sys.exit(f'the floor leg finds {off}' if off else 0)"
	PYTHONPATH=$(abspath $(FLOOR)) $(ALL_TIERS) -m floor -p no:cacheprovider

# The user guide: the configuration reference generated from the schema (docs/reference/config.md), then the site
# built with --strict (a broken link or anchor, or a page missing from the navigation, fails) into site/; not --quiet,
# which hides the warnings --strict counts (mkdocs 1.6.1).
docs: setup
	$(PY) -m megatron_ppo.config.reference docs/reference/config.md
	$(VENV)/bin/mkdocs build --strict

# Rewrite the lock from the environment after changing a range in pyproject.toml (pip install -U ... first).
lock: setup
	{ sed -n '1,3p' $(LOCK); $(PY) -m pip freeze --exclude-editable | grep -v '^megatron-ppo'; } > $(LOCK).new && mv $(LOCK).new $(LOCK)

lint: setup
	$(VENV)/bin/ruff check megatron_ppo tests bench gpu_check slurm
	$(VENV)/bin/ruff format --check megatron_ppo tests bench gpu_check slurm

RECIPE ?= recipes/tiny-cpu.yaml
NPROC  ?= 2

# The main job: the tiny recipe end to end on CPU (data, SFT, offline PPO, evaluation table), then its figure
# (<trainer.log_dir>/<run id>.png).
train: setup
	$(TRAIN) $(RECIPE) $(OVERRIDES)
	$(PY) -m megatron_ppo report $(RECIPE) $(OVERRIDES) --plot

# Rewards from a reward model (reward_model.*) for every row of the recipe's data, written to new Parquet files (the
# tiny recipe: its task's own reward model, trained from the task's labels on first use, scores its dataset).
score: setup
	$(TORCHRUN) --nproc_per_node $(NPROC) -m megatron_ppo score $(RECIPE) $(OVERRIDES)

# The README's figure (docs/tiny-cpu.png) from the recipe's latest run (make train first).
figure: setup
	$(PY) -m megatron_ppo report $(RECIPE) $(OVERRIDES) --plot docs/tiny-cpu.png

# The tiny recipe with the KL term off, fixed, adaptive, staged power law and staged PI: one table side by side, and one figure of the five.
compare-kl: setup
	$(TORCHRUN) --nproc_per_node $(NPROC) -m megatron_ppo compare-kl $(RECIPE) $(OVERRIDES) --plot

# The fault drill: the tiny recipe with a NaN gradient, a gradient spike, an out-of-memory error, a KL blow-up and an
# evaluation drop injected (test-only patches, tests/drill); prints where each guard fired and draws the run with the
# faults marked ($(DRILL_DIR)/drill.png). A new folder per drill.
DRILL_STAMP := $(shell date -u +%Y%m%d-%H%M%S)
DRILL_DIR ?= outputs/drill/$(DRILL_STAMP)
drill: setup
	$(TORCHRUN) --nproc_per_node $(NPROC) -m tests.drill $(RECIPE) trainer.default_local_dir=$(DRILL_DIR)/checkpoints trainer.log_dir=$(DRILL_DIR)/tensorboard --plot $(DRILL_DIR)/drill.png $(OVERRIDES)

# The faults a user can cause (damaged checkpoints, a conversion into a run, a second job, a full disk, ...), each
# through the real CLI on a copy of one short tiny run: a table of fault, what the user saw, exit status, what was kept.
faults: setup
	$(PY) -m tests.faults $(FAULTS)

# A profiled run of the recipe, to the end of the step range: make profile [RECIPE=...] STEPS=a:b [NPROC=2] profiles
# the iterations a ≤ n < b (profiling.profile_step_start/end) with the torch profiler on rank 0, in a scratch run
# ($(PROFILE_DIR)); then `report` names its trace. OVERRIDES="profiling.profile_ranks=[0,1] ..." for more.
STEPS ?= 2:4
PROFILE_DIR ?= outputs/profile/$(DRILL_STAMP)
profile: setup
	$(TRAIN) $(RECIPE) profiling.use_pytorch_profiler=true \
		profiling.profile_step_start=$(word 1,$(subst :, ,$(STEPS))) profiling.profile_step_end=$(word 2,$(subst :, ,$(STEPS))) \
		trainer.total_training_steps=$(shell echo $$(( $(word 2,$(subst :, ,$(STEPS))) - 1 ))) trainer.save_freq=-1 \
		trainer.resume_mode=disable trainer.default_local_dir=$(PROFILE_DIR)/checkpoints trainer.log_dir=$(PROFILE_DIR)/tensorboard $(OVERRIDES)
	$(PY) -m megatron_ppo report $(PROFILE_DIR)/tensorboard

# Layout check, per-GPU memory and step-time estimate before any job (exit 1 when it does not fit).
plan: setup
	$(PY) -m megatron_ppo plan $(RECIPE) $(if $(NODES),--nodes $(NODES)) $(OVERRIDES)

# sbatch on the cluster, sized from the recipe's cluster section:
#   make submit RECIPE=... [NODES=4] [CHAIN=3] [SCORE=1: the scoring job] [DRY_RUN=1] [LOG_DIR=logs] [OVERRIDES="key=value ..."]
submit: setup
	$(PY) slurm/submit.py $(RECIPE) $(if $(NODES),--nodes $(NODES)) $(if $(CHAIN),--chain $(CHAIN)) $(if $(SCORE),--score) $(if $(DRY_RUN),--dry-run) $(if $(LOG_DIR),--log-dir $(LOG_DIR)) $(OVERRIDES)

# A run's metrics (first/last/min/max) and guard/checkpoint events from its TensorBoard files.
report: setup
	$(PY) -m megatron_ppo report $(RECIPE) $(OVERRIDES)

validate: setup
	$(PY) -m megatron_ppo validate $(RECIPE) $(OVERRIDES)

# Benchmarks print ratios measured side by side in one run (not timed tests).
bench: setup
	$(TORCHRUN) --nproc_per_node 2 -m bench.bench_logprobs
	$(TORCHRUN) --nproc_per_node 1 -m bench.bench_actor_step
	$(TORCHRUN) --nproc_per_node 1 -m bench.bench_lora_step
	$(TORCHRUN) --nproc_per_node 2 -m bench.bench_ppo_step
	$(TORCHRUN) --nproc_per_node 2 -m bench.bench_pipeline_shapes
	$(TORCHRUN) --nproc_per_node 2 -m bench.bench_async_save
	$(TORCHRUN) --nproc_per_node 2 -m bench.bench_async_save --hidden-size 1024
	$(TORCHRUN) --nproc_per_node 2 -m bench.bench_packing
	$(TORCHRUN) --nproc_per_node 1 -m bench.bench_logprob_chunks
	$(TORCHRUN) --nproc_per_node 1 -m bench.bench_decode
	$(TORCHRUN) --nproc_per_node 1 -m bench.bench_router_replay
	$(TORCHRUN) --nproc_per_node 2 -m bench.bench_task_sft
	$(PY) -m bench.bench_gae
	$(PY) -m bench.bench_data

# The data path alone: 10^6 token-id rows prepared and mapped, 50,000 text rows beside tokenizers' encode_batch
# (≈ 17 GB under outputs/bench/data while it runs; BENCH_DATA_ARGS="--rows 200000" for less).
bench-data: setup
	$(PY) -m bench.bench_data $(BENCH_DATA_ARGS)

# The GPU check (one CUDA GPU, no network, ≤ 330 s by its estimate): the card read first, each part sized to it and in
# its own process, its result printed as it ends (gpu_check/__main__.py): the tiny recipe on CUDA, a 1.5B-shaped PPO
# iteration (tokens/s, MFU, peak memory against the planner), GPU bf16 against CPU fp32 log-probs, offload,
# micro-batch cuts, resume, the first update, layouts (2 GPUs), KV-cached decoding; outputs/gpu_check.json.
# `make gpu-check DRY_RUN=1` runs it on the CPU with a tiny model (CI does); DRY_RUN=1 CARD=h100 (or h200) plans
# every real part for that card and fails over its memory; PARTS=a,b,... runs some parts.
# Works without `make setup` on a bare CUDA machine (Python 3.12 and PyTorch, no network): `make gpu-wheels` here
# fetches what it lacks at the lock's versions into .whl/ — only what the machine named by TARGET (its
# `pip list --format=freeze`; gpu_check/targets/ has the lent H200's) lacks; TARGET= for a bare Python + PyTorch —
# there they are installed once into .whl/site and put on PYTHONPATH with the source tree, and the check first
# names any module that still does not import.
WHEELS ?= .whl
TARGET ?= gpu_check/targets/nvidia-h200.txt
gpu-wheels:
	PY=$(PY) bash gpu_check/wheels.sh $(WHEELS) $(TARGET)

GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	@if ls .whl/*.whl >/dev/null 2>&1 && [ ! -d .whl/site ]; then \
		$(GPU_PY) -m pip install -q --no-index --no-deps --target .whl/site .whl/*.whl; fi
	@PYTHONPATH=$(CURDIR):$(CURDIR)/.whl/site$(if $(PYTHONPATH),:$(PYTHONPATH)) $(GPU_PY) -m gpu_check.wheels --check
	PYTHONPATH=$(CURDIR):$(CURDIR)/.whl/site$(if $(PYTHONPATH),:$(PYTHONPATH)) OMP_NUM_THREADS=$(or $(OMP_NUM_THREADS),8) \
		$(GPU_PY) -m gpu_check $(if $(DRY_RUN),--dry-run) $(if $(CARD),--card $(CARD)) $(if $(PARTS),--parts $(PARTS)) $(ARGS)
