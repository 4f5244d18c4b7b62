"""The tiny task's cache is kept per task fingerprint: another task setting, seed or model shape never reads it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megatron_ppo.config.compose import load_config
from megatron_ppo.config.schema import ModelConfig
from megatron_ppo.tasks.addition.recipe import NOT_IN_FINGERPRINT, task_directory

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


def _changed(value: object, choices: tuple | None) -> object:
    """Another value of a model key's type (not necessarily a valid one: the cache key does not validate)."""
    if choices:
        return next(c for c in choices if c != value)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    return 7 if value is None else f"{value}-other"


def test_every_model_key_outside_the_exclusions_changes_the_cache(tmp_path: Path) -> None:
    config = load_config(TINY, [f"data.addition.work_dir={tmp_path}"])
    first = task_directory(config)
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    assert set(NOT_IN_FINGERPRINT) <= set(fields), "an exclusion names no model key"
    for name, field in fields.items():
        value = _changed(getattr(config.model, name), field.metadata.get("choices"))
        other = task_directory(dataclasses.replace(config, model=dataclasses.replace(config.model, **{name: value})))
        if name in NOT_IN_FINGERPRINT:
            assert other == first, f"model.{name} is excluded ({NOT_IN_FINGERPRINT[name]}) but changed the cache"
        else:
            assert other != first, (
                f"model.{name}={value!r} reused the cache of model.{name}={getattr(config.model, name)!r}"
            )
