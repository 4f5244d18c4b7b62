"""Config composition, aliases, resolution and validation — and every config file in the repo."""

from __future__ import annotations

import json
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest

from megatron_ppo.cli import main
from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.compose import CONFIG_DIR
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import ModelConfig, PPOConfig
from megatron_ppo.train.kl_coefficients import build_kl_coefficients

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "tiny-cpu.yaml"
ALL_CONFIGS = sorted([*CONFIG_DIR.rglob("*.yaml"), *(REPO / "recipes").glob("*.yaml")])


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_recipe_and_preset_validates(path: Path) -> None:
    load_config(path)


def test_a_validated_config_refuses_writes_and_changes_only_as_a_copy() -> None:
    config = load_config(TINY)
    read_only = r"cannot assign {}: the config is read-only once validated"
    with pytest.raises(FrozenInstanceError, match=read_only.format(r"actor\.ppo_micro_batch_size_per_gpu")):
        config.actor.ppo_micro_batch_size_per_gpu = 1
    with pytest.raises(FrozenInstanceError, match=read_only.format(r"algorithm\.kl_ctrl\.stages\[1\]\.target_kl")):
        config.algorithm.kl_ctrl.stages[1].target_kl = 0.5
    with pytest.raises(FrozenInstanceError, match=read_only.format("model")):
        config.model = ModelConfig()
    with pytest.raises(FrozenInstanceError, match=read_only.format(r"model\.init_checkpoint")):
        del config.model.init_checkpoint
    changed = with_changes(config, {"actor.optim.lr": 2e-4, "trainer.seed": 7})
    assert (changed.actor.optim.lr, changed.trainer.seed) == (2e-4, 7)
    assert (config.actor.optim.lr, config.trainer.seed) == (1e-4, 1), "with_changes wrote into the original"
    with pytest.raises(FrozenInstanceError, match=read_only.format(r"actor\.optim\.lr")):
        changed.actor.optim.lr = 1.0
    with pytest.raises(KeyError, match=r"actor\.optim\.learning_rate is not a config key; known under actor\.optim"):
        with_changes(config, {"actor.optim.learning_rate": 1.0})
    unvalidated = PPOConfig()
    unvalidated.actor.optim.lr = 3e-4  # a config under construction (not yet validated) is written freely
    with_changes(unvalidated, {"trainer.seed": 2})
    unvalidated.model.num_layers = 4  # ... and stays so when a changed copy of it is frozen


def test_the_roles_a_config_needs_are_derived_once() -> None:
    config = load_config(TINY)
    assert config.needs_reference and config.needs_critic
    no_kl = ["actor.use_kl_loss=false", "algorithm.kl_ctrl.type=fixed", "~algorithm.kl_ctrl.stages"]
    grpo = load_config(TINY, ["algorithm.adv_estimator=grpo", *no_kl])
    assert not grpo.needs_critic and not grpo.needs_reference
    with pytest.raises(ConfigError, match=r"action kl_bump needs a KL term"):
        load_config(TINY, [*no_kl, "guards.watch=[{metric: kl/std, max: 0.1, action: kl_bump}]"])


def test_recipes_open_with_a_launch_line_and_hardware() -> None:
    for recipe in (REPO / "recipes").glob("*.yaml"):
        header = recipe.read_text().split("\n\n")[0]
        assert "Launch:" in header and "Hardware:" in header, f"{recipe.name} header lacks Launch:/Hardware:"


def test_later_files_then_overrides_win(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text("actor:\n  clip_ratio: 0.1\n  ppo_epochs: 3\n")
    (tmp_path / "recipe.yaml").write_text("defaults: [defaults, base]\nactor:\n  ppo_epochs: 5\n")
    config = load_config(tmp_path / "recipe.yaml", ["actor.ppo_epochs=7"])
    assert (config.actor.clip_ratio, config.actor.ppo_epochs) == (0.1, 7)
    assert config.actor.kl_loss_type == "low_var_kl", "configs/defaults.yaml must be found from anywhere"


def test_lists_are_replaced_not_merged() -> None:
    config = load_config(
        CONFIG_DIR / "kl" / "staged.yaml", ["algorithm.kl_ctrl.stages=[{name: all, end: 1.0, controller: fixed}]"]
    )
    assert [s.name for s in config.algorithm.kl_ctrl.stages] == ["all"]


def test_verl_paths_are_aliases() -> None:
    config = load_config(
        TINY,
        [
            "actor_rollout_ref.actor.clip_ratio_low=0.25",
            "actor_rollout_ref.actor.optim.lr=3e-6",
            "actor_rollout_ref.ref.megatron.recompute_granularity=selective",
            "trainer.n_gpus_per_node=2",
        ],
    )
    assert config.actor.clip_ratio_low == 0.25
    assert config.actor.optim.lr == 3e-6
    assert config.ref.megatron.recompute_granularity == "selective"
    assert config.cluster.gpus_per_node == 2


def test_clip_ratio_is_the_default_of_low_and_high() -> None:
    config = load_config(TINY, ["actor.clip_ratio=0.3"])
    assert (config.actor.clip_ratio_low, config.actor.clip_ratio_high) == (0.3, 0.3)
    config = load_config(TINY, ["actor.clip_ratio=0.3", "actor.clip_ratio_high=0.4"])
    assert (config.actor.clip_ratio_low, config.actor.clip_ratio_high) == (0.3, 0.4)


def _problems(*overrides: str, recipe: Path = TINY) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(recipe, overrides)
    return str(error.value)


PP2 = [
    f"{role}.megatron.{key}"
    for role in ("actor", "ref", "critic")
    for key in ("tensor_model_parallel_size=1", "pipeline_model_parallel_size=2")
]
INVALID = [
    (["actor.clip_ratoi=0.3"], ["actor.clip_ratoi", "did you mean 'actor.clip_ratio'"]),
    (["actor.gamma=0.9"], ["actor.gamma", "lives at 'algorithm.gamma'"]),
    (["actor.optim.lr=fast"], ["actor.optim.lr", "fast"]),
    (["actor.clip_ratio_c=1.0"], ["actor.clip_ratio_c=1.0", "> 1"]),
    (["actor.kl_loss_coef=-0.1"], ["actor.kl_loss_coef=-0.1", "≥ 0"]),
    (["algorithm.lam=1.5"], ["algorithm.lam=1.5", "[0, 1]"]),
    (["actor.loss_agg_mode=mean"], ["actor.loss_agg_mode='mean'", "token-mean"]),
    (["actor.kl_loss_type=k5"], ["actor.kl_loss_type='k5'", "low_var_kl"]),
    (["data.train_batch_size=500"], ["data.train_batch_size=500", "actor.ppo_mini_batch_size=128"]),
    (["actor.ppo_micro_batch_size_per_gpu=48"], ["actor.ppo_micro_batch_size_per_gpu=48", "use a micro-batch among"]),
    (
        ["actor.megatron.tensor_model_parallel_size=1", "actor.ppo_mini_batch_size=127", "data.train_batch_size=127"],
        ["actor.ppo_mini_batch_size=127", "data-parallel size 2"],
    ),
    (
        ["actor.megatron.tensor_model_parallel_size=3", "cluster.gpus_per_node=3"],
        ["actor.megatron.tensor_model_parallel_size=3", "num_attention_heads=4"],
    ),
    (
        ["model.num_query_groups=2", "cluster.gpus_per_node=4", "actor.megatron.tensor_model_parallel_size=4"],
        ["num_query_groups=2", "divisible by TP"],
    ),
    ([*PP2, "model.num_layers=3"], ["critic.megatron", "num_layers=3", "PP×VPP"]),
    (["critic.megatron.tensor_model_parallel_size=1"], ["critic.megatron.tensor_model_parallel_size=1", "share one"]),
    (["cluster.gpus_per_node=3"], ["world size 3", "multiple of 2"]),
    (
        ["actor.megatron.sequence_parallel=true", "actor.megatron.tensor_model_parallel_size=1"],
        ["sequence_parallel=True needs tensor_model_parallel_size > 1"],
    ),
    (
        ["critic.megatron.virtual_pipeline_model_parallel_size=2", "critic.megatron.pipeline_model_parallel_size=1"],
        ["virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size ≥ 2"],
    ),
    (["algorithm.kl_ctrl.type=adaptive", "actor.use_kl_loss=false"], ["drives no KL term"]),
    (["reward.clip_range=[2, -2]"], ["reward.clip_range=[2.0, -2.0]", "low < high"]),
    (["trainer.resume_mode=resume_path"], ["trainer.resume_from_path"]),
    (["actor_rollout_ref.rollout.n=4"], ["has no rollout"]),
    (["actor.optim.lr"], ["key=value"]),
]


@pytest.mark.parametrize(("overrides", "expected"), INVALID, ids=lambda v: " ".join(v)[:60])
def test_invalid_config_names_the_key_and_the_fix(overrides: list[str], expected: list[str]) -> None:
    message = _problems(*overrides)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"


STAGED = CONFIG_DIR / "kl" / "staged.yaml"
INVALID_STAGES = [
    (["algorithm.kl_ctrl.stages[1].end=0.01"], ["stages[1] (early).end=0.01", "ordered"]),
    (["algorithm.kl_ctrl.stages[3].end=0.9"], ["cover the whole run", "1.0"]),
    (["algorithm.kl_ctrl.stages[2].target_kl=0"], ["stages[2] (mid).target_kl=0", "target KL > 0"]),
    (["algorithm.kl_ctrl.stages[2].controller=warmup"], ["only the first stage may be a warm-up"]),
    (["algorithm.kl_ctrl.stages[2].guards={kl_explode: 0.3}"], ["guards.kl_explode", "kl_explosion_threshold"]),
    (["algorithm.kl_ctrl.stages[2].name=early"], ["'early' is used twice"]),
    (["algorithm.kl_ctrl.type=fixed"], ["stages is set but algorithm.kl_ctrl.type='fixed'"]),
    (
        ["algorithm.kl_ctrl.stage_unit=step", "trainer.total_training_steps=10"],
        ["must cover trainer.total_training_steps=10"],
    ),
]


@pytest.mark.parametrize(("overrides", "expected"), INVALID_STAGES, ids=lambda v: " ".join(v)[:60])
def test_invalid_kl_stages_are_reported(overrides: list[str], expected: list[str]) -> None:
    message = _problems(*overrides, recipe=STAGED)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"


def test_all_problems_are_reported_at_once() -> None:
    message = _problems("algorithm.lam=2", "actor.clip_ratio_c=0.5", "cluster.gpus_per_node=3")
    assert "5 config problems" in message, "one per bad key, and the world size once per role"
    assert all(k in message for k in ("algorithm.lam", "actor.clip_ratio_c", "world size 3"))


def test_defaults_errors_are_clear(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("defaults: [b]\n")
    (tmp_path / "b.yaml").write_text("defaults: [a]\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("defaults: [kl/stagd]\n")
    with pytest.raises(ConfigError, match="did you mean 'kl/staged'"):
        load_config(tmp_path / "c.yaml")


def test_staged_preset_builds_the_documented_schedule() -> None:
    config = load_config(STAGED)
    schedule = build_kl_coefficients(config, total_steps=1000)["loss"]
    assert schedule.stage_ends == [50, 200, 700, 1000]
    assert [s.target_kl for s in schedule.stages] == [None, 0.008, 0.012, 0.015]
    assert {s.alpha for s in schedule.stages[1:]} == {1.5}
    assert schedule.value == 0.0 and schedule.kl_coef == 0.001


def test_controller_drives_only_the_terms_listed_in_apply_to() -> None:
    both = ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.stages=[]",
            "algorithm.kl_ctrl.kl_coef=0.02", "actor.kl_loss_coef=0.1"]  # fmt: skip
    coefficients = build_kl_coefficients(load_config(TINY, both), total_steps=10)
    assert {t: c.kind for t, c in coefficients.items()} == {"loss": "adaptive", "reward": "adaptive"}
    assert coefficients["loss"].value == 0.1 and coefficients["reward"].value == 0.02
    only_reward = load_config(TINY, [*both, "algorithm.kl_ctrl.apply_to=[reward]"])
    coefficients = build_kl_coefficients(only_reward, total_steps=10)
    assert {t: c.kind for t, c in coefficients.items()} == {"loss": "fixed", "reward": "adaptive"}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """`megatron_ppo.cli.main` in this process (the command line's own entry, its error contract included): (exit
    status, stdout, stderr)."""
    status = main(list(args))
    out, err = capsys.readouterr()
    return status, out, err


def test_cli_validate_prints_the_resolved_config(capsys) -> None:
    status, out, err = _cli(capsys, "validate", str(TINY), "actor.clip_ratio=0.3")
    assert status == 0, err
    assert "clip_ratio_low: 0.3" in out


def test_cli_validate_exits_2_with_the_message_and_no_traceback(capsys) -> None:
    status, _, err = _cli(capsys, "validate", str(TINY), "algorithm.lam=3")
    assert status == 2
    assert "algorithm.lam=3" in err and "Traceback" not in err


def test_loss_scale_factor_is_a_constant_by_default_as_in_verl() -> None:
    config = load_config(TINY, ["data.max_response_length=7"])
    assert (config.actor.loss_scale_factor, config.critic.loss_scale_factor) == (7, 7)
    config = load_config(TINY, ["actor.loss_scale_factor=3"])
    assert (config.actor.loss_scale_factor, config.critic.loss_scale_factor) == (3, 3)


def test_each_role_has_its_own_experience_micro_batch_size() -> None:
    config = load_config(TINY, ["ref.log_prob_micro_batch_size_per_gpu=32", "critic.ppo_micro_batch_size_per_gpu=64"])
    assert config.ref.log_prob_micro_batch_size_per_gpu == 32
    assert config.actor.log_prob_micro_batch_size_per_gpu == config.actor.ppo_micro_batch_size_per_gpu
    assert config.critic.forward_micro_batch_size_per_gpu == 64


def test_a_dataset_run_without_initial_weights_is_refused_before_any_model_is_built(tmp_path: Path, capsys) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1=", "response": "2", "reward": 1.0}\n')
    one_process = [f"{role}.megatron.tensor_model_parallel_size=1" for role in ("actor", "ref", "critic")]
    status, _, err = _cli(capsys, "train", str(TINY), "data.task=null", f"data.train_files=[{data}]",
                          "model.tokenizer=any.model", "cluster.gpus_per_node=1", *one_process)  # fmt: skip
    assert status == 2, err
    assert "no initial weights" in err and "model.allow_random_init=true" in err
    assert "Traceback" not in err


def test_keys_that_do_not_apply_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"data.val_files is for dataset runs; data.task='addition'"):
        load_config(TINY, ["data.val_files=[a.jsonl]"])
    with pytest.raises(ConfigError, match=r"guards.watch\[0\].action='shout' is not one of 'warn', 'lr_backoff'"):
        load_config(TINY, ["guards.watch=[{metric: kl/mean, max: 0.1, action: shout}]"])
    with pytest.raises(ConfigError, match=r"stages\[1\] \(early\).guards.watch: unknown guard"):
        load_config(TINY, ["algorithm.kl_ctrl.stages[1].guards={watch: 1.0}"])
    with pytest.raises(ConfigError, match=r"unknown key 'guards.skip_nonfinite'"):
        load_config(TINY, ["guards.skip_nonfinite=false"])


def test_each_key_carries_its_own_rule_on_the_schema() -> None:
    """Choices and ranges live on the schema fields; validation walks them in every section, shared ones too."""
    from megatron_ppo.config.fields import choices_of, field_problems
    from megatron_ppo.config.schema import DataConfig, MegatronConfig, PPOConfig

    config = PPOConfig()
    config.critic.megatron.recompute_method = "sometimes"
    config.actor.optim.adam_beta2 = 1.0
    config.data.format = "xml"
    assert field_problems(config) == [
        "data.format='xml' is not one of 'auto', 'jsonl', 'parquet'",
        "actor.optim.adam_beta2=1.0: must be in [0, 1)",
        "critic.megatron.recompute_method='sometimes' is not one of None, 'uniform', 'block'",
    ]
    assert choices_of(DataConfig, "format") == ("auto", "jsonl", "parquet")
    assert choices_of(MegatronConfig, "recompute_granularity") == (None, "full", "selective")


LLAMA31_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}  # fmt: skip
LLAMA_70B = REPO / "recipes" / "llama3.1-70b.yaml"


def _checkpoint(tmp_path: Path, rope_scaling: dict | None) -> str:
    """A directory holding only a Llama-3.1-style config.json (as published: `rope_scaling` and `rope_theta`)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 500000.0,
                                                      "rope_scaling": rope_scaling}))  # fmt: skip
    return f"model.hf_checkpoint={tmp_path}"


def test_a_llama31_checkpoint_validates_with_the_recipes_rope_scaling(tmp_path: Path) -> None:
    assert load_config(LLAMA_70B, [_checkpoint(tmp_path, LLAMA31_ROPE_SCALING)]).model.rope_scaling_factor == 8.0


@pytest.mark.parametrize(
    ("rope_scaling", "expected"),
    [
        ({"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type='yarn' is not supported"),
        ({"type": "dynamic", "factor": 2.0}, "rope_scaling.rope_type='dynamic' is not supported"),
        ({**LLAMA31_ROPE_SCALING, "low_freq_factor": 2.0}, "rope_scaling.low_freq_factor=2.0: Megatron's"),
        ({**LLAMA31_ROPE_SCALING, "original_max_position_embeddings": 4096}, "original_max_position_embeddings=4096"),
        (
            {**LLAMA31_ROPE_SCALING, "factor": 32.0},
            "model.rope_scaling_factor=8.0, but the checkpoint's RoPE scaling "
            "factor is 32.0; set model.rope_scaling_factor=32.0",
        ),
        (None, "set model.rope_scaling_factor=null (no scaling)"),
    ],
    ids=["yarn", "dynamic", "low-freq-factor", "original-context", "other-factor", "unscaled-checkpoint"],
)
def test_a_recipe_naming_a_checkpoint_with_rope_scaling_megatron_cannot_express_is_refused(
    tmp_path: Path, rope_scaling: dict | None, expected: str
) -> None:
    message = _problems(_checkpoint(tmp_path, rope_scaling), recipe=LLAMA_70B)
    assert expected in message and f"model.hf_checkpoint={tmp_path}" in message, message


def test_rope_scaling_factor_needs_rope_and_a_factor_of_at_least_one() -> None:
    assert "model.rope_scaling_factor=0.5: must be ≥ 1" in _problems("model.rope_scaling_factor=0.5")
    assert "use rope" in _problems("model.rope_scaling_factor=8", "model.position_embedding_type=learned_absolute")


@pytest.mark.parametrize("value", ["[a.jsonl", "[a.jsonl, b.jsonl", "{path: a.jsonl"])
def test_an_override_opening_a_list_it_does_not_close_is_refused(value: str) -> None:
    """`data.train_files=[a.jsonl` was read as one file named `[a.jsonl` (YAML could not parse it, and the text was
    kept as written); now it is a config problem naming the override and the fix. Text YAML cannot read that opens no
    list or mapping stays text."""
    with pytest.raises(ConfigError, match=r"does not parse.*close it with"):
        load_config(TINY, [f"data.train_files={value}"])
    assert load_config(TINY, ["data.train_files=[a.jsonl]"]).data.train_files == ["a.jsonl"]
