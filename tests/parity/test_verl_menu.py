"""verl 0.9.1's menu — every registered policy loss, advantage estimator and off-policy correction — against ours, on
the same random and adversarial tensors (empty rows, a one-token row, log-ratios past ±20, responses that start
after a prompt), with verl's own config classes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.config.algorithm import AlgoConfig
from verl.trainer.ppo import core_algos as verl
from verl.trainer.ppo import rollout_corr_helper as verl_corr
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

from megatron_ppo import algo
from megatron_ppo.algo.rollout_correction import ROLLOUT_RS_OPTIONS
from tests.parity.helpers import SHAPES, assert_matches_verl, make_batch

AGG_MODES = list(algo.LOSS_AGGREGATIONS)
# the settings of the losses that have their own, set so that each loss's special branch is taken
LOSS_SETTINGS = {"clip_cov_ratio": 0.05, "clip_cov_lb": 0.05, "clip_cov_ub": 5.0, "kl_cov_ratio": 0.05,
                 "ppo_kl_coef": 0.3, "dro_beta": 0.1}  # fmt: skip
CLIPS = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": 3.0, "tau_pos": 1.0,
         "tau_neg": 1.05}  # fmt: skip


def test_every_verl_policy_loss_and_estimator_is_registered_or_refused_with_a_reason() -> None:
    theirs = set(verl.POLICY_LOSS_REGISTRY) - {"bypass_mode"}
    assert theirs == set(algo.POLICY_LOSSES), theirs ^ set(algo.POLICY_LOSSES)
    estimators = {str(e.value) for e in verl.AdvantageEstimator} - {"grpo_vectorized", "rloo_vectorized"}
    ours = set(algo.ADV_ESTIMATORS) | set(algo.ROLLOUT_ONLY_ESTIMATORS)
    assert estimators == ours, estimators ^ ours


def _realistic(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Log-probs are ≤ 0 (the adversarial +30 steps of `make_batch` would put old probabilities above 1)."""
    return {**batch, "old_log_prob": batch["old_log_prob"].clamp(max=0.0)}


def _verl_actor(mode: str, **batch_info) -> ActorConfig:
    config = ActorConfig(strategy="megatron", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=2, rollout_n=1,
                         **CLIPS, policy_loss=PolicyLossConfig(loss_mode=mode, **LOSS_SETTINGS))  # fmt: skip
    config.global_batch_info.update(batch_info)
    return config


def _ours(**batch_info) -> algo.PolicyLossConfig:
    return algo.PolicyLossConfig(**CLIPS, **LOSS_SETTINGS, global_batch_info=batch_info)


def _run_loss(fn, b, mode: str, config, weights: torch.Tensor | None):
    log_prob = b["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(0)  # clip_cov draws its tokens from the global generator
    loss, metrics = fn(b["old_log_prob"], log_prob, b["advantages"], b["mask"], mode, config, weights)
    loss.backward()
    return loss.detach(), log_prob.grad, metrics


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", list(algo.POLICY_LOSSES))
def test_policy_loss_matches_verl(loss_mode: str, agg_mode: str, shape: tuple[int, int]) -> None:
    b = _realistic(make_batch(*shape, seed=31))
    ours = _run_loss(algo.get_policy_loss_fn(loss_mode), b, agg_mode, _ours(), None)
    theirs = _run_loss(verl.get_policy_loss_fn(loss_mode), b, agg_mode, _verl_actor(loss_mode), None)
    _compare_loss(f"policy_loss[{loss_mode}]", ours, theirs)


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", list(algo.POLICY_LOSSES))
def test_policy_loss_with_global_counts_and_correction_weights_matches_verl(loss_mode: str, agg_mode: str) -> None:
    b = _realistic(make_batch(16, 20, seed=32))
    weights, _ = algo.compute_rollout_correction_weights(b["old_log_prob"] - b["ref_log_prob"], b["mask"], "token")
    info = {"dp_size": 4, "batch_num_tokens": 777, "global_batch_size": 61, "loss_scale_factor": 64}
    ours = _run_loss(algo.get_policy_loss_fn(loss_mode), b, agg_mode, _ours(**info), weights)
    theirs = _run_loss(verl.get_policy_loss_fn(loss_mode), b, agg_mode, _verl_actor(loss_mode, **info), weights)
    if loss_mode == "geo_mean":  # verl's GMPO averages the rows in hand; ours divides by the mini-batch's rows
        scale = b["mask"].shape[0] / info["global_batch_size"] * info["dp_size"]
        theirs = (theirs[0] * scale, theirs[1] * scale, theirs[2])
    _compare_loss(f"policy_loss[{loss_mode}] global counts + IS weights", ours, theirs)


def _compare_loss(name: str, ours, theirs) -> None:
    (our_loss, our_grad, our_metrics), (their_loss, their_grad, their_metrics) = ours, theirs
    assert torch.isfinite(our_loss), f"{name}: loss {our_loss}"
    assert_matches_verl(name, our_loss, their_loss)
    assert_matches_verl(f"{name} grad", our_grad, their_grad)
    assert {f"actor/{k}" for k in our_metrics} == set(their_metrics), (set(our_metrics), set(their_metrics))
    for key, value in our_metrics.items():
        assert_matches_verl(f"{name} {key}", value, their_metrics[f"actor/{key}"])


def _labels(rows: int, singleton: bool) -> np.ndarray:
    labels = np.array([f"uid-{i % max(1, rows // 3)}" for i in range(rows)], dtype=object)
    if singleton:
        labels[0] = "singleton"
    return labels


def _shifted(mask: torch.Tensor, seed: int) -> torch.Tensor:
    """The responses moved right by a random prompt length per row (our layout: label positions of the whole row)."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(mask.shape[0], mask.shape[1] * 2)
    for row, offset in enumerate(torch.randint(0, mask.shape[1] + 1, (mask.shape[0],), generator=gen).tolist()):
        out[row, offset : offset + mask.shape[1]] = mask[row]
    return out


OUTCOME_ESTIMATORS = [name for name in algo.ADV_ESTIMATORS if name != "gae"]  # gae: test_verl_parity


@pytest.mark.parametrize("layout", ["response-aligned", "after-prompt"])
@pytest.mark.parametrize("scores", ["ties", "continuous"])
@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("shape", [(6, 7), (16, 33), (32, 5)])
@pytest.mark.parametrize("estimator", OUTCOME_ESTIMATORS)
def test_advantage_estimator_matches_verl(estimator: str, shape, norm_by_std: bool, scores: str, layout: str) -> None:
    b = make_batch(*shape, seed=33)
    mask = b["mask"] if layout == "response-aligned" else _shifted(b["mask"], seed=34)
    gen = torch.Generator().manual_seed(35)
    if scores == "ties":  # outcome rewards on the last response token, many equal within a group
        last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
        rewards = last * torch.randint(-1, 2, (shape[0], 1), generator=gen).float()
    else:
        rewards = torch.randn(mask.shape, generator=gen) * mask
    labels = _labels(shape[0], singleton=estimator != "grpo_passk")  # pass@k refuses groups of one
    config = AlgoConfig(gamma=0.95, norm_adv_by_std_in_grpo=norm_by_std)
    kwargs = {"token_level_rewards": rewards, "response_mask": mask, "index": labels, "config": config}
    if estimator == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = norm_by_std  # verl's trainer passes it by keyword to GRPO only
    ours, ours_ret = algo.get_adv_estimator_fn(estimator)(**{**kwargs, "token_level_rewards": rewards.clone()})
    theirs, theirs_ret = verl.get_adv_estimator_fn(estimator)(**{**kwargs, "token_level_rewards": rewards.clone()})
    assert_matches_verl(f"adv_estimator[{estimator}] advantages", ours, theirs)
    assert_matches_verl(f"adv_estimator[{estimator}] returns", ours_ret, theirs_ret)


def _rs_threshold(options: str) -> str:
    return ",".join("0.6_1.8" if o.endswith("k1") else "0.4" for o in options.split(","))


RS_CASES = [None, *ROLLOUT_RS_OPTIONS, "token_k1,seq_mean_k3,seq_max_k2"]


@pytest.mark.parametrize("rollout_rs", RS_CASES)
@pytest.mark.parametrize("batch_normalize", [False, True])
@pytest.mark.parametrize("threshold", ["2.0", "0.5_2.0"])
@pytest.mark.parametrize("rollout_is", [None, "token", "sequence"])
def test_rollout_correction_matches_verl(rollout_is, threshold: str, batch_normalize: bool, rollout_rs) -> None:
    b = _realistic(make_batch(24, 17, seed=36))
    behaviour = b["log_prob"] + torch.randn(b["mask"].shape, generator=torch.Generator().manual_seed(37)) * 0.2
    behaviour = behaviour.clamp(max=0.0)  # fmt: skip
    args = (b["old_log_prob"], behaviour, b["mask"], rollout_is, threshold, batch_normalize, rollout_rs,
            None if rollout_rs is None else _rs_threshold(rollout_rs))  # fmt: skip
    our_weights, our_mask, ours = algo.compute_rollout_correction_and_rejection_mask(*args)
    their_weights, their_mask, theirs = verl_corr.compute_rollout_correction_and_rejection_mask(*args)
    if rollout_is is None:
        assert our_weights is None and their_weights is None
    else:
        assert_matches_verl(f"rollout_is[{rollout_is}] weights", our_weights, their_weights.batch["rollout_is_weights"])
    assert_matches_verl(f"rollout_rs[{rollout_rs}] mask", our_mask, their_mask, tol=0.0)
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for key in theirs:
        assert_matches_verl(f"rollout_corr/* metrics (is={rollout_is})", ours[key], theirs[key])


def test_offpolicy_metrics_match_verl_on_extreme_log_ratios() -> None:
    b = make_batch(16, 33, seed=38)  # old − ref log-ratios beyond ±20 on 5% of the tokens
    ours = algo.compute_offpolicy_metrics(b["old_log_prob"], b["ref_log_prob"], b["mask"])
    theirs = verl_corr.compute_offpolicy_metrics(b["old_log_prob"], b["ref_log_prob"], b["mask"])
    assert set(ours) == set(theirs)
    for key, value in ours.items():
        assert_matches_verl(f"offpolicy_metrics {key}", value, theirs[key])
