"""Run identity: the config hash ignores exactly the keys meant to change on resume, and the differences a resume
prints are split the same way."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from megatron_ppo.checkpoint.run_identity import (
    PER_JOB_KEYS,
    RunIdentity,
    config_differences,
    flatten_config,
    meant_to_change,
    new_run_id,
    unflatten_config,
)
from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.schema import MICRO_BATCHING, RUN_CONTROL, RUN_LENGTH, PPOConfig

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def test_the_hash_ignores_run_control_length_and_layout_only() -> None:
    base = RunIdentity.of("r", load_config(TINY))
    same_experiment = [
        "trainer.exit_interval=5", "trainer.resume_mode=disable", "trainer.default_local_dir=/elsewhere",
        "trainer.log_dir=/logs", "trainer.save_freq=3", "trainer.total_training_steps=40",
        "actor.megatron.tensor_model_parallel_size=1", "ref.megatron.tensor_model_parallel_size=1",
        "critic.megatron.tensor_model_parallel_size=1", "cluster.gpus_per_node=1", "cluster.device=cuda",
        "actor.ppo_micro_batch_size_per_gpu=32", "critic.ppo_micro_batch_size_per_gpu=64",
    ]  # fmt: skip
    assert RunIdentity.of("r", load_config(TINY, same_experiment)).config_hash == base.config_hash
    for other in ["actor.optim.lr=2e-4", "trainer.seed=2", "algorithm.kl_ctrl.stages[1].target_kl=0.3",
                  "data.train_batch_size=256", "actor.ppo_epochs=3"]:  # fmt: skip
        assert RunIdentity.of("r", load_config(TINY, [other])).config_hash != base.config_hash, other


def test_the_keys_meant_to_change_are_the_schemas_per_job_fields() -> None:
    micro_batching = ["actor.ppo_micro_batch_size_per_gpu", "actor.log_prob_micro_batch_size_per_gpu",
                      "actor.use_dynamic_bsz", "actor.ppo_max_token_len_per_gpu",
                      "ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu",
                      "critic.forward_micro_batch_size_per_gpu", "critic.use_dynamic_bsz",
                      "critic.ppo_max_token_len_per_gpu"]  # fmt: skip
    run_control = ["resume_mode", "resume_from_path", "overwrite", "exit_interval", "exit_duration_in_mins",
                   "logger", "save_freq", "test_freq", "val_before_train", "max_ckpt_to_keep", "default_local_dir",
                   "log_dir", "async_save"]  # fmt: skip
    profiling = ["use_pytorch_profiler", "profile_step_start", "profile_step_end", "profile_ranks", "record_shapes",
                 "record_memory_history", "memory_snapshot_path", "use_nsys_profiler", "nvtx_ranges"]  # fmt: skip
    expected = (
        dict.fromkeys(micro_batching, MICRO_BATCHING)
        | dict.fromkeys(["trainer.total_epochs", "trainer.total_training_steps"], RUN_LENGTH)
        | {f"trainer.{key}": RUN_CONTROL for key in run_control}
        | {f"profiling.{key}": RUN_CONTROL for key in profiling}  # what a job watches, not what the run trains
        | {"data.prepared_dir": RUN_CONTROL}  # where the same rows are found, not which rows
    )
    assert expected == PER_JOB_KEYS
    flat = flatten_config(PPOConfig())
    assert set(PER_JOB_KEYS) <= set(flat), "a per_job key that the config does not have"
    defining = sorted(k for k in flat if k.startswith("trainer.") and not meant_to_change(k))
    assert defining == ["trainer.critic_warmup", "trainer.experiment_name", "trainer.project_name", "trainer.seed"]


def test_differences_name_each_key_with_both_values() -> None:
    saved = flatten_config(load_config(TINY))
    current = flatten_config(
        load_config(TINY, ["actor.optim.lr=2e-4", "trainer.exit_interval=5", "trainer.save_freq=4"])
    )
    expected, other = config_differences(saved, current)
    assert other == ["actor.optim.lr: 0.0001 → 0.0002"]
    assert expected == ["trainer.exit_interval: None → 5", "trainer.save_freq: 10 → 4"]
    assert config_differences(saved, saved) == ([], [])


def test_a_key_only_one_side_has_is_shown_absent() -> None:
    expected, other = config_differences({"a.b": 1}, {"a.c": 2})
    assert (expected, other) == ([], ["a.b: 1 → '(absent)'", "a.c: '(absent)' → 2"])


def test_flattened_keys_are_dotted_and_lists_stay_whole() -> None:
    flat = flatten_config(load_config(TINY))
    assert flat["actor.megatron.tensor_model_parallel_size"] == 2
    assert [stage["name"] for stage in flat["algorithm.kl_ctrl.stages"]] == ["warmup", "early", "mid", "late"]
    assert meant_to_change("actor.megatron.tensor_model_parallel_size") and not meant_to_change("actor.optim.lr")


def test_identity_round_trips_through_run_json(tmp_path: Path) -> None:
    identity = RunIdentity.of(new_run_id(), load_config(TINY))
    identity.write(tmp_path)
    assert RunIdentity.read(tmp_path) == identity
    assert RunIdentity.read(tmp_path / "nothing") is None


def test_run_ids_sort_by_start_time_and_differ_within_a_second() -> None:
    first, second = new_run_id(now=0.0), new_run_id(now=0.0)
    assert re.fullmatch(r"19700101-000000-[0-9a-f]{6}", first) and first != second
    assert new_run_id(now=86400.0) > first


def test_overwrite_with_auto_resume_is_refused() -> None:
    with pytest.raises(ConfigError, match=re.escape("trainer.overwrite=true moves other runs' checkpoints aside")):
        load_config(TINY, ["trainer.overwrite=true"])
    assert load_config(TINY, ["trainer.overwrite=true", "trainer.resume_mode=disable"]).trainer.overwrite


@pytest.mark.parametrize("recipe", [TINY, TINY.parent / "qwen3-235b-a22b.yaml"], ids=lambda p: p.stem)  # + MoE, PP
def test_the_typed_config_comes_back_from_its_flat_form(recipe: Path, tmp_path: Path) -> None:
    """What `report --plot` reads from a run's `run.json` is the config the run resolved, every key equal."""
    config = load_config(recipe)
    RunIdentity.of("r", config, total_steps=7).write(tmp_path)
    saved = RunIdentity.read(tmp_path)
    assert saved.total_steps == 7 and unflatten_config(saved.config) == config
