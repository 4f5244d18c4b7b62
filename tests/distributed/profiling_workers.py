"""Spawned-rank code for the profiler test (`test_profiling.py`): the tiny recipe's trainer, profiled."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from bench.bench_ppo_step import synthetic_rows
from bench.tiny import RECIPE
from megatron_ppo.config import load_config
from megatron_ppo.parallel import init_distributed
from megatron_ppo.train import profiling
from megatron_ppo.train.ppo import PPOTrainer
from megatron_ppo.train.profiling import TRACES

TRAIN_BATCH = 32  # small batches: the profile, not the training, is under test


def profiled_run(rank: int, world_size: int, root: str, overrides: list[str]) -> dict[str, Any]:
    """Train the tiny recipe (random weights, synthetic rows) with `overrides` (`profiling.*`); return the names of
    the ranges in this rank's trace (None: no trace) and what the run logged about profiling."""
    torch.set_num_threads(1)
    config = load_config(RECIPE, [
        "data.task=null", "model.allow_random_init=true", "trainer.logger=[console]", "trainer.resume_mode=disable",
        f"trainer.default_local_dir={root}/checkpoints", f"trainer.log_dir={root}/tensorboard",
        f"data.train_batch_size={TRAIN_BATCH}", f"actor.ppo_mini_batch_size={TRAIN_BATCH}",
        f"critic.ppo_mini_batch_size={TRAIN_BATCH}", f"actor.ppo_micro_batch_size_per_gpu={TRAIN_BATCH}",
        f"critic.ppo_micro_batch_size_per_gpu={TRAIN_BATCH}", *overrides,
    ])  # fmt: skip
    init_distributed(config.actor.megatron, seed=0)
    said: list[str] = []
    build = profiling.Profiler.__init__

    def recording(self, config, log_dir, rank, say) -> None:  # what the profiler logs, from its construction on
        build(self, config, log_dir, rank, lambda line: (said.append(line), say(line)))

    profiling.Profiler.__init__ = recording
    trainer = PPOTrainer(config, synthetic_rows(256, config.model.vocab_size, seed=0), pad_id=0)
    trainer.fit()
    trainer.close()
    folder = Path(trainer.run.log_dir) / TRACES
    traces = sorted(folder.glob(f"rank{rank}.*.pt.trace.json"))
    names = None
    if traces:
        events = json.loads(traces[0].read_text())["traceEvents"]
        names = sorted({event["name"] for event in events if event.get("cat") == "user_annotation"})
    return {"traces": [p.name for p in traces], "names": names, "said": said}
