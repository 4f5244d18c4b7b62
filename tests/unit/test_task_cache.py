"""The tiny task's cache is kept per task fingerprint: another task setting, seed or model shape never reads it."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_ppo.config.compose import load_config
from megatron_ppo.tasks.addition.recipe import task_directory

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def test_same_task_same_cache_other_task_its_own(tmp_path: Path) -> None:
    def directory(*overrides: str) -> Path:
        return task_directory(load_config(TINY, [f"data.addition.work_dir={tmp_path}", *overrides]))

    first = directory()
    assert first.parent == tmp_path and first.name.startswith("task-")
    recorded = json.loads((first / "task.json").read_text())
    assert recorded["data.addition.num_prompts"] == 2000 and recorded["trainer.seed"] == 1
    assert directory("actor.optim.lr=3e-4", "trainer.total_epochs=1") == first, "PPO settings do not change the task"
    others = {directory("data.addition.num_prompts=1000"), directory("trainer.seed=2"),
              directory("model.hidden_size=64", "model.num_attention_heads=2")}  # fmt: skip
    assert first not in others and len(others) == 3
    assert json.loads((directory("trainer.seed=2") / "task.json").read_text())["trainer.seed"] == 2
