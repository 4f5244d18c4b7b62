"""A verl user's Megatron PPO command line on our recipes: verl's own example lands key by key where verl puts it,
rollout keys are refused with the reason, Hydra's `+key`/`~key` work, and value-mapped verl keys set ours."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.validate import get

REPO = Path(__file__).resolve().parents[2]
RECIPE_7B = REPO / "recipes" / "qwen2.5-7b.yaml"
TINY = REPO / "recipes" / "tiny-cpu.yaml"
TRAIN_FILES = "['/data/gsm8k/train.parquet', '/data/math/train.parquet']"
VAL_FILES = "['/data/gsm8k/test.parquet', '/data/math/test.parquet']"

# volcengine/verl examples/ppo_trainer/run_qwen2-7b_math_gsm8k_megatron.sh (commit 3f38806), every override but
# the rollout keys: (the override as verl's script writes it, our key, the value it must land as).
VERL_EXAMPLE: list[tuple[str, str, Any]] = [
    ("algorithm.adv_estimator=gae", "algorithm.adv_estimator", "gae"),
    (f"data.train_files={TRAIN_FILES}", "data.train_files", ["/data/gsm8k/train.parquet", "/data/math/train.parquet"]),
    (f"data.val_files={VAL_FILES}", "data.val_files", ["/data/gsm8k/test.parquet", "/data/math/test.parquet"]),
    ("data.train_batch_size=1024", "data.train_batch_size", 1024),
    ("data.max_prompt_length=1024", "data.max_prompt_length", 1024),
    ("data.max_response_length=512", "data.max_response_length", 512),
    ("data.filter_overlong_prompts=True", "data.overlong_policy", "filter"),
    ("data.truncation='error'", "data.overlong_policy", "filter"),  # filtered first: truncation never fires
    ("actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct", "model.hf_checkpoint", "Qwen/Qwen2-7B-Instruct"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor.optim.lr", 1e-6),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor.ppo_mini_batch_size", 256),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor.ppo_micro_batch_size_per_gpu", 4),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "actor.megatron.pipeline_model_parallel_size",
     2),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor.megatron.tensor_model_parallel_size", 2),
    ("actor_rollout_ref.actor.use_kl_loss=False", "actor.use_kl_loss", False),
    ("actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2", "ref.megatron.pipeline_model_parallel_size", 2),
    ("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2", "ref.megatron.tensor_model_parallel_size", 2),
    ("critic.optim.lr=1e-5", "critic.optim.lr", 1e-5),
    ("critic.model.path=Qwen/Qwen2-7B-Instruct", "critic.model.hf_checkpoint", "Qwen/Qwen2-7B-Instruct"),
    ("critic.model.enable_gradient_checkpointing=False", "critic.megatron.recompute_granularity", None),
    ("critic.ppo_micro_batch_size_per_gpu=4", "critic.ppo_micro_batch_size_per_gpu", 4),
    ("algorithm.use_kl_in_reward=False", "algorithm.use_kl_in_reward", False),
    ("trainer.critic_warmup=0", "trainer.critic_warmup", 0),
    ("trainer.logger=['console','wandb']", "trainer.logger", ["console", "wandb"]),
    ("trainer.project_name='verl_ppo_gsm8k_math_examples'", "trainer.project_name", "verl_ppo_gsm8k_math_examples"),
    ("trainer.experiment_name='qwen2_7b_megatron'", "trainer.experiment_name", "qwen2_7b_megatron"),
    ("trainer.n_gpus_per_node=8", "cluster.gpus_per_node", 8),
    ("trainer.nnodes=1", "cluster.nodes", 1),
    ("trainer.save_freq=20", "trainer.save_freq", 20),
    ("trainer.test_freq=5", "trainer.test_freq", 5),
    ("trainer.total_epochs=100", "trainer.total_epochs", 100),
]  # fmt: skip
# Keys the issue met in verl's other Megatron scripts.
VERL_SCRIPTS_ALSO: list[tuple[str, str, Any]] = [
    ("+trainer.val_before_train=False", "trainer.val_before_train", False),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "ref.log_prob_micro_batch_size_per_gpu", 4),
]
ROLLOUT_KEYS = [
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
    "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
]
# What validation asks of this recipe beyond verl's list: the critic on the actor's layout (the recipe's critic
# is TP 4; the roles must share one layout), and no KL controller when both KL terms are off (the recipe's is
# the staged schedule, which would then drive nothing).
FIXES = [
    "critic.megatron.tensor_model_parallel_size=2",
    "critic.megatron.pipeline_model_parallel_size=2",
    "algorithm.kl_ctrl.type=fixed",
    "~algorithm.kl_ctrl.stages",
]


def _overrides(table: list[tuple[str, str, Any]]) -> list[str]:
    return [override for override, _, _ in table]


def test_verl_example_on_the_7b_recipe_is_refused_only_where_the_recipe_and_the_script_disagree() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(RECIPE_7B, _overrides(VERL_EXAMPLE + VERL_SCRIPTS_ALSO))
    layout, kl = refused.value.problems
    assert "must share one parallel layout" in layout, layout
    assert "the nearest shared layout is the actor's (TP 2 PP 2 CP 1): set " + " ".join(FIXES[:2]) in layout, layout
    for written in ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size"):  # fmt: skip
        assert f"{written} sets {written.removeprefix('actor_rollout_ref.')}" in layout, layout
    assert "algorithm.kl_ctrl.type='staged' drives no KL term" in kl and " ".join(FIXES[2:]) in kl, kl
    assert "actor_rollout_ref.actor.use_kl_loss sets actor.use_kl_loss" in kl, kl


def test_verl_example_lands_key_by_key_where_verl_puts_it() -> None:
    config = load_config(RECIPE_7B, [*_overrides(VERL_EXAMPLE + VERL_SCRIPTS_ALSO), *FIXES])
    landed = {key: get(config, key) for _, key, _ in VERL_EXAMPLE + VERL_SCRIPTS_ALSO}
    expected = {key: value for _, key, value in VERL_EXAMPLE + VERL_SCRIPTS_ALSO}
    assert landed == expected
    # enable_gradient_checkpointing=False turns the recipe's selective recompute of the critic off
    critic = config.critic.megatron
    assert (critic.recompute_granularity, critic.recompute_method, critic.recompute_num_layers) == (None, None, None)
    assert config.actor.megatron.recompute_granularity == "selective", "the actor keeps the recipe's recompute"


@pytest.mark.parametrize("rollout", ROLLOUT_KEYS)
def test_rollout_keys_are_refused_because_offline_ppo_has_no_rollout(rollout: str) -> None:
    with pytest.raises(ConfigError, match="offline PPO trains on a fixed dataset and has no rollout"):
        load_config(RECIPE_7B, [rollout])


def test_hydra_plus_sets_a_key_and_tilde_puts_it_back_to_the_schema_default() -> None:
    config = load_config(RECIPE_7B, ["+actor.optim.lr=3e-6", "~trainer.save_freq", "~reward"])
    assert config.actor.optim.lr == 3e-6
    assert config.trainer.save_freq == 0, "the recipe's save_freq: 50 is deleted: the schema default applies"
    assert config.reward.clip_range is None, "a deleted section takes the schema defaults, not the recipe's [-2, 2]"


def test_a_plus_does_not_make_an_unknown_key_known() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, ["+trainer.balance_batch=True"])
    (problem,) = refused.value.problems
    assert problem.startswith("unknown key 'trainer.balance_batch'")
    assert "+ does not make an unknown key known" in problem


def test_deleting_an_unknown_key_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"~trainer.save_frequency: unknown key, nothing to delete; did you mean"):
        load_config(TINY, ["~trainer.save_frequency"])


@pytest.mark.parametrize(
    ("written", "section", "value", "recompute"),
    [
        ("critic.model.enable_gradient_checkpointing", "critic", True, ("full", "uniform", 1)),
        ("actor_rollout_ref.model.enable_gradient_checkpointing", "actor", True, ("full", "uniform", 1)),
        ("critic.model.enable_gradient_checkpointing", "critic", False, (None, None, None)),
    ],
)
def test_gradient_checkpointing_sets_that_roles_recompute(written: str, section: str, value: bool, recompute) -> None:
    config = load_config(RECIPE_7B, [f"{written}={value}"])  # the recipe: selective recompute for actor and critic
    layout = get(config, f"{section}.megatron")
    assert (layout.recompute_granularity, layout.recompute_method, layout.recompute_num_layers) == recompute
    untouched = config.critic if section == "actor" else config.actor
    assert untouched.megatron.recompute_granularity == "selective"


def test_gradient_checkpointing_takes_a_boolean_and_runs_on_cpu() -> None:
    with pytest.raises(ConfigError, match="enable_gradient_checkpointing=0: give true or false"):
        load_config(RECIPE_7B, ["actor_rollout_ref.model.enable_gradient_checkpointing=0"])
    config = load_config(TINY, ["critic.model.enable_gradient_checkpointing=True"])  # the CPU recipe
    assert config.critic.megatron.recompute_granularity == "full"


@pytest.mark.parametrize(
    ("overrides", "policy", "side"),
    [
        ([], "filter", "left"),
        (["data.filter_overlong_prompts=True"], "filter", "left"),
        (["data.filter_overlong_prompts=False"], "error", "left"),  # verl's default truncation: error
        (["data.truncation=middle"], "truncate", "middle"),
        (["data.truncation=error", "data.filter_overlong_prompts=True"], "filter", "left"),
        (["data.filter_overlong_prompts=True", "data.truncation=right"], "filter", "right"),
        (["data.truncation=right", "data.filter_overlong_prompts=False"], "truncate", "right"),
    ],
)
def test_filter_overlong_prompts_and_truncation_are_read_together_as_verl_reads_them(
    overrides: list[str], policy: str, side: str
) -> None:
    data = load_config(TINY, overrides).data
    assert (data.overlong_policy, data.prompt_truncation) == (policy, side)


def test_a_truncation_verl_does_not_have_is_refused_with_its_choices() -> None:
    with pytest.raises(ConfigError, match=r"data\.truncation='top': give one of error, left, right, middle"):
        load_config(TINY, ["data.truncation=top"])


@pytest.mark.parametrize("key", ["data.truncation", "critic.model.enable_gradient_checkpointing"])
def test_a_verl_key_that_sets_several_of_ours_cannot_be_deleted(key: str) -> None:
    with pytest.raises(ConfigError, match=f"~{key}: this verl key sets several of ours, so it cannot be deleted"):
        load_config(TINY, [f"~{key}"])


def test_save_freq_minus_one_means_never_and_below_is_refused() -> None:
    assert load_config(TINY, ["trainer.save_freq=-1"]).trainer.save_freq == -1
    with pytest.raises(ConfigError, match=r"trainer.save_freq=-2: must be ≥ -1 \(-1: never, 0: only at the end\)"):
        load_config(TINY, ["trainer.save_freq=-2"])


@pytest.mark.parametrize("logger", ["wandb", "mlflow"])
def test_a_logger_without_its_extra_is_refused_with_the_install_line(logger: str, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, logger, None)  # Python's own way to make an import fail
    with pytest.raises(ConfigError, match=rf"{logger} is not installed; install the extra \(pip install 'megatron-ppo"):
        load_config(TINY, [f"trainer.logger=[console,{logger}]"])


def test_per_role_layouts_are_refused_naming_the_verl_keys_and_the_nearest_shared_layout() -> None:
    overrides = [
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=4",
        "actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size=4",
        "critic.megatron.pipeline_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=1",
        "actor.megatron.tensor_model_parallel_size=1",
        "ref.megatron.tensor_model_parallel_size=1",
        "trainer.n_gpus_per_node=8",
        "model.num_layers=16",
    ]
    with pytest.raises(ConfigError) as refused:
        load_config(TINY, overrides)
    (layout,) = [p for p in refused.value.problems if "share one parallel layout" in p]
    assert layout.startswith(
        "actor.megatron.pipeline_model_parallel_size=2, ref.megatron.pipeline_model_parallel_size=4, "
        "critic.megatron.pipeline_model_parallel_size=2:"
    ), layout
    assert "nearest shared layout is the actor's (TP 1 PP 2 CP 1): set ref.megatron.pipeline_model_parallel_size=2" in (
        layout
    )
    assert (
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size sets ref.megatron.pipeline_model_parallel_size"
        in (layout)
    )


def test_the_wandb_logger_without_the_extra_fails_with_the_install_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from megatron_ppo.config.schema import PPOConfig
    from megatron_ppo.train.metrics import MetricsLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(RuntimeError, match=r"wandb is not installed; install the extra \(pip install 'megatron-ppo"):
        MetricsLogger(tmp_path, ["wandb"], 1, config=PPOConfig(), run_id="run")
