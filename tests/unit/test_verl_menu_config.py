"""verl's keys for the policy-loss, advantage-estimator and off-policy-correction menu: where they land, what is
refused and why, and what the trainer reports of rows whose behaviour policy is far from the actor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ppo import algo
from megatron_ppo.config import load_config
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.fields import choices_of
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import AlgorithmConfig, GuardsConfig, PolicyLossSettings, WatchConfig
from megatron_ppo.train.experience import rollout_correction
from megatron_ppo.train.guards import Guards
from megatron_ppo.train.observers import offpolicy_report

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def _problems(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(RECIPE, overrides)
    return str(error.value)


def test_schema_choices_are_the_registries_keys() -> None:
    assert choices_of(PolicyLossSettings, "loss_mode") == tuple(algo.POLICY_LOSSES)
    assert choices_of(AlgorithmConfig, "adv_estimator") == (*algo.ADV_ESTIMATORS, *algo.ROLLOUT_ONLY_ESTIMATORS)


def test_verl_spellings_land_on_our_keys_and_one_path_is_a_list() -> None:
    config = load_config(RECIPE, [
        "actor_rollout_ref.actor.policy_loss.loss_mode=cispo", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.tau_neg=1.2", "algorithm.adv_estimator=rloo",
        "algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=0.5_2",
        "algorithm.rollout_correction.rollout_rs=token_k1,seq_max_k3",
        "algorithm.rollout_correction.rollout_rs_threshold=0.5_2,3", "data.train_files=/data/train.parquet",
        "data.val_files=/data/val.parquet", "data.task=null", "model.allow_random_init=true",
    ])  # fmt: skip
    assert config.actor.policy_loss.loss_mode == "cispo" and config.actor.tau_neg == 1.2
    assert config.algorithm.adv_estimator == "rloo"
    correction = config.algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold) == ("sequence", "0.5_2")  # not YAML's 0.52
    assert correction.rollout_rs_threshold == "0.5_2,3"
    assert (config.data.train_files, config.data.val_files) == (["/data/train.parquet"], ["/data/val.parquet"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.adv_estimator=remax"], "'remax' cannot run offline: ReMax's baseline is the reward of a greedy"),
        (["algorithm.adv_estimator=optimal_token_baseline"], "Σπ² over the vocabulary"),
        (["actor.policy_loss.loss_mode=dro"], "needs actor.policy_loss.dro_beta > 0"),
        (["actor.policy_loss.loss_mode=bypass_mode"], "actor.policy_loss.loss_mode='bypass_mode' is not one of"),
        (["algorithm.rollout_correction.bypass_mode=true"], "bypass mode (old_log_prob = the behaviour log-probs"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=seq_max_k1",
                "algorithm.rollout_correction.rollout_rs_threshold=2",
            ],
            "unknown ['seq_max_k1']; use token_k1",
        ),
        (["algorithm.rollout_correction.rollout_rs=token_k2"], "rollout_rs_threshold is required with rollout_rs"),
        (["algorithm.rollout_correction.rollout_rs_threshold=2"], "rollout_rs_threshold is set but rollout_rs is not"),
        (
            [
                "algorithm.rollout_correction.rollout_rs=token_k2",
                "algorithm.rollout_correction.rollout_rs_threshold=0.1_2",
            ],
            "'0.1_2' for token_k2: give one positive number",
        ),
        (["algorithm.rollout_correction.rollout_is_threshold=2_1"], "bounds must be positive with lower ≤ upper"),
    ],
)
def test_impossible_menu_settings_are_refused_with_the_fix(overrides: list[str], message: str) -> None:
    problems = _problems(overrides)
    assert message in problems, problems


def _batch(shift: float) -> tuple[dict, dict]:
    """Rows whose behaviour log-probs are the actor's raised by `shift` nats on three tokens in four (the behaviour
    policy was far surer of its tokens than the actor is)."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.ones(8, 10)
    mask[:, :2] = 0  # prompt positions
    old = (-4 - torch.rand(8, 10, generator=gen) * 2) * mask
    behaviour = (old + shift * (torch.arange(10) % 4 != 2)) * mask
    rows = torch.ones(8, dtype=torch.bool)
    return {"loss_mask": mask, "behavior_log_prob": behaviour.clamp(max=0), "behavior_rows": rows}, {
        "old_log_prob": old
    }


def test_rows_far_from_the_actor_are_reported_at_the_start_with_the_numbers() -> None:
    config = load_config(RECIPE)
    _, _, near = rollout_correction(config, *_batch(shift=0.0))
    assert near["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-7)
    assert near["rollout_corr/rollout_is_eff_sample_size"] == pytest.approx(1.0)
    assert offpolicy_report(config, near).startswith("behaviour log-probs vs the actor at step 0: ESS 1.000")
    _, _, far = rollout_correction(config, *_batch(shift=4.0))
    assert far["rollout_corr/rollout_is_eff_sample_size"] < config.algorithm.rollout_correction.min_eff_sample_size
    report = offpolicy_report(config, far)
    assert report.startswith("WARNING: the rows' behaviour policy is far from the actor at step 0 — ESS 0.")
    assert "ratio inside the threshold band on" in report
    assert f"KL(μ‖π) {far['rollout_corr/kl']:.4f}" in report and "min_eff_sample_size=0.5" in report
    assert offpolicy_report(config, {}) is None  # rows without behaviour log-probs
    _, _, shifted = rollout_correction(config, *_uniform_shift())
    assert shifted["rollout_corr/rollout_is_eff_sample_size"] > 0.99, "a uniform shift keeps the weights even"
    assert offpolicy_report(config, shifted).startswith("WARNING"), "…but every ratio is far outside the band"


def _uniform_shift() -> tuple[dict, dict]:
    batch, passes = _batch(shift=0.0)
    return {**batch, "behavior_log_prob": (passes["old_log_prob"] + 3.0).clamp(max=0) * batch["loss_mask"]}, passes


def test_rejected_tokens_leave_the_loss_mask_and_weights_need_behaviour_log_probs() -> None:
    config = load_config(RECIPE, ["algorithm.rollout_correction.rollout_rs=token_k2",
                                  "algorithm.rollout_correction.rollout_rs_threshold=1.0"])  # fmt: skip
    batch, passes = _batch(shift=4.0)  # k2 = ½·4² = 8 > 1 on every shifted token: 6 of each row's 8
    corrected, weights, metrics = rollout_correction(config, batch, passes)
    assert weights == {}
    assert corrected["loss_mask"].sum() == batch["loss_mask"].sum() / 4
    assert metrics["rollout_corr/rollout_rs_token_k2_masked_fraction"] == pytest.approx(0.75)
    config = with_changes(config, {"algorithm.rollout_correction.rollout_is": "token"})
    with pytest.raises(ValueError, match="8 of this batch's 8 rows carry none: give every row"):
        rollout_correction(config, {"loss_mask": batch["loss_mask"]}, passes)
    with pytest.raises(ValueError, match="3 of this batch's 8 rows carry none"):
        rollout_correction(config, {**batch, "behavior_rows": torch.arange(8) >= 3}, passes)


def test_diagnostics_leave_out_the_rows_without_behaviour_log_probs() -> None:
    config = load_config(RECIPE)
    batch, passes = _batch(shift=0.0)
    batch["behavior_log_prob"][:3] = 0.0  # what collate holds for rows without them
    _, _, metrics = rollout_correction(config, {**batch, "behavior_rows": torch.arange(8) >= 3}, passes)
    assert metrics["rollout_corr/kl"] == pytest.approx(0.0, abs=1e-7), "rows without behaviour log-probs counted"


def test_a_watch_rule_acts_on_the_off_policy_metrics() -> None:
    guards = Guards(GuardsConfig(watch=[WatchConfig("rollout_corr/kl", 0.5, "lr_backoff")]))
    config = load_config(RECIPE)
    _, _, far = rollout_correction(config, *_batch(shift=4.0))
    actions = guards.observe(far, skipped=False)
    assert [(a.kind, a.guard) for a in actions] == [("lr_backoff", "watch")], actions
    assert "rollout_corr/kl" in actions[0].message


def test_collate_marks_the_rows_that_carry_behaviour_log_probs() -> None:
    from megatron_ppo.data.rows import Row
    from megatron_ppo.train.batch import collate

    def row(log_probs: list[float] | None) -> Row:
        return Row(prompt_ids=[1, 2], response_ids=[3, 4], reward=1.0, token_rewards=None,
                   behavior_log_probs=log_probs, uid="u", data_source="test", source="test:0")  # fmt: skip

    batch = collate([row([-0.5, -0.25]), row(None)], pad_id=0)
    assert batch["behavior_rows"].tolist() == [True, False]
    assert batch["behavior_log_prob"][0, 1:3].tolist() == [-0.5, -0.25]
    assert "behavior_rows" not in collate([row(None)], pad_id=0)
