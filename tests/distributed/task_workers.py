"""Code that runs inside the ranks of tests/distributed/test_task_layout.py: the tiny task built at its own layout."""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core import parallel_state

from bench.tiny import RECIPE
from megatron_ppo.config import load_config
from megatron_ppo.parallel import init_distributed
from megatron_ppo.tasks.addition import recipe

# A task of seconds: 64 prompts, 8 SFT steps of 16 rows, 2 samples per prompt
SMALL_TASK = ["data.addition.num_prompts=64", "data.addition.num_heldout=8", "data.addition.sft_steps=8",
              "data.addition.sft_batch_size=16", "data.addition.samples_per_prompt=2"]  # fmt: skip


def _groups() -> tuple[int, int, int]:
    return (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_data_parallel_world_size())  # fmt: skip


def built_then_found(rank: int, world_size: int, work: Path, layout: list[str]) -> dict:
    """The tiny task (`SMALL_TASK`, the run at `layout`) prepared twice: built, then found in its cache. Returns the
    process groups inside `in_task_layout` and after it, and whether this rank's RNG state after each preparation is
    the one it was seeded with."""
    config = load_config(RECIPE, [*SMALL_TASK, *layout, f"data.addition.work_dir={work}",
                                  f"trainer.default_local_dir={work}/checkpoints"])  # fmt: skip
    init_distributed(config.actor.megatron, seed=config.trainer.seed)
    run_groups, states = _groups(), [torch.get_rng_state()]  # as seeded
    with recipe.in_task_layout(config):
        task_groups = _groups()
    restored = _groups()
    for _ in range(2):
        task = recipe.prepare_addition_task(config)
        states.append(torch.get_rng_state())
    return {"run": run_groups, "task": task_groups, "restored": restored, "after_prepare": _groups(),
            "rng_as_seeded": [torch.equal(states[0], state) for state in states[1:]], "rows": len(task.rows),
            "sft": task.sft_checkpoint}  # fmt: skip
