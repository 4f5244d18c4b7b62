"""Our algorithm core against verl 0.9.1 (`verl.trainer.ppo.core_algos`), on the same random tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import verl.utils.torch_functional as verl_F
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos as verl

from megatron_ppo import algo
from tests.parity.helpers import SHAPES, assert_matches_verl, make_batch

KINDS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _grads(fn, *inputs: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    weights = torch.rand(out.shape, generator=torch.Generator().manual_seed(seed))
    (out * weights).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", KINDS + [k + "+" for k in KINDS])
def test_kl_penalty_values_and_gradients_match_verl(kind: str, shape: tuple[int, int]) -> None:
    b = make_batch(*shape, seed=1)
    ours, our_grads = _grads(lambda p, r: algo.kl_penalty(p, r, kind), b["log_prob"], b["ref_log_prob"], seed=2)
    theirs, their_grads = _grads(lambda p, r: verl.kl_penalty(p, r, kind), b["log_prob"], b["ref_log_prob"], seed=2)
    assert_matches_verl(f"kl_penalty[{kind}]", ours, theirs)
    for name, ours_g, theirs_g in zip(("log_prob", "ref_log_prob"), our_grads, their_grads, strict=True):
        assert_matches_verl(f"kl_penalty[{kind}] grad {name}", ours_g, theirs_g)


def _verl_actor_config(clip_low: float, clip_high: float, clip_c: float, **batch_info):
    return OmegaConf.create(
        {
            "clip_ratio": 0.2,
            "clip_ratio_low": clip_low,
            "clip_ratio_high": clip_high,
            "clip_ratio_c": clip_c,
            "global_batch_info": batch_info,
        }
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize(("clip_low", "clip_high", "clip_c"), [(0.2, 0.2, 3.0), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)])
def test_vanilla_policy_loss_clip_settings_match_verl(
    mode: str, shape, clip_low: float, clip_high: float, clip_c: float
) -> None:
    b = make_batch(*shape, seed=3)
    config = algo.PolicyLossConfig(clip_ratio_low=clip_low, clip_ratio_high=clip_high, clip_ratio_c=clip_c)

    def ours_fn(log_prob):
        return algo.get_policy_loss_fn("vanilla")(b["old_log_prob"], log_prob, b["advantages"], b["mask"], mode, config)

    def theirs_fn(log_prob):
        cfg = _verl_actor_config(clip_low, clip_high, clip_c)
        return verl.compute_policy_loss_vanilla(
            b["old_log_prob"], log_prob, b["advantages"], b["mask"], loss_agg_mode=mode, config=cfg
        )

    our_lp = b["log_prob"].clone().requires_grad_(True)
    their_lp = b["log_prob"].clone().requires_grad_(True)
    (our_loss, our_metrics), (their_loss, their_metrics) = ours_fn(our_lp), theirs_fn(their_lp)
    our_loss.backward()
    their_loss.backward()
    assert_matches_verl(f"policy_loss[vanilla, {mode}]", our_loss, their_loss)
    assert_matches_verl(f"policy_loss[vanilla, {mode}] grad", our_lp.grad, their_lp.grad)
    for key in ("pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"):
        assert_matches_verl(f"policy_loss[vanilla] {key}", our_metrics[key], their_metrics[f"actor/{key}"])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_verl(mode: str, shape) -> None:
    b = make_batch(*shape, seed=6)
    assert_matches_verl(
        f"agg_loss[{mode}]", algo.agg_loss(b["rewards"], b["mask"], mode), verl.agg_loss(b["rewards"], b["mask"], mode)
    )
    info = {"dp_size": 2, "batch_num_tokens": 100, "global_batch_size": 9, "loss_scale_factor": 50}
    assert_matches_verl(
        f"agg_loss[{mode}] global counts",
        algo.agg_loss(b["rewards"], b["mask"], mode, **info),
        verl.agg_loss(b["rewards"], b["mask"], mode, **info),
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_verl(mode: str, shape) -> None:
    b = make_batch(*shape, seed=7)
    vpreds = b["values"] + torch.randn(shape, generator=torch.Generator().manual_seed(8)) * 0.5
    ours_v = vpreds.clone().requires_grad_(True)
    theirs_v = vpreds.clone().requires_grad_(True)
    ours, ours_frac = algo.value_loss(
        ours_v, b["returns"], b["values"], b["mask"], cliprange_value=0.2, loss_agg_mode=mode
    )
    theirs, theirs_frac = verl.compute_value_loss(theirs_v, b["returns"], b["values"], b["mask"], 0.2, mode)
    ours.backward()
    theirs.backward()
    assert_matches_verl(f"value_loss[{mode}]", ours, theirs)
    assert_matches_verl(f"value_loss[{mode}] grad", ours_v.grad, theirs_v.grad)
    assert_matches_verl("value_loss clipfrac", ours_frac, theirs_frac)


@pytest.mark.parametrize("shape", [(4, 3), (6, 7), (16, 33), (32, 128)])
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9)])
def test_gae_matches_verl(shape, gamma: float, lam: float) -> None:
    b = make_batch(*shape, seed=9)
    ours_adv, ours_ret = algo.gae_advantages(b["rewards"], b["values"], b["mask"], gamma, lam)
    theirs_adv, theirs_ret = verl.compute_gae_advantage_return(b["rewards"], b["values"], b["mask"], gamma, lam)
    # relative to the largest value: verl's float32 loop carries running sums whose rounding grows along the row,
    # our float64 scan does not (tests/unit/test_gae_scan.py)
    scale = max(1.0, float(theirs_adv.abs().max()), float(theirs_ret.abs().max()))
    assert_matches_verl("gae_advantages advantages", ours_adv / scale, theirs_adv / scale)
    assert_matches_verl("gae_advantages returns", ours_ret / scale, theirs_ret / scale)


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_grpo_matches_verl_loop_and_vectorized(shape, norm_by_std: bool) -> None:
    b = make_batch(*shape, seed=10)
    scores = torch.zeros(shape)
    scores[:, -1] = torch.randint(-1, 2, (shape[0],), generator=torch.Generator().manual_seed(11)).float()
    # groups of 4, 3, 1 (a singleton) and the rest, labelled by strings as a dataset's uid column would be
    labels = np.array([f"uid-{i % max(1, shape[0] // 3)}" for i in range(shape[0])], dtype=object)
    labels[0] = "singleton"
    ours, ours_ret = algo.grpo_advantages(scores, b["mask"], list(labels), norm_adv_by_std_in_grpo=norm_by_std)
    loop, _ = verl.compute_grpo_outcome_advantage(scores, b["mask"], labels, norm_adv_by_std_in_grpo=norm_by_std)
    vectorized, _ = verl.compute_grpo_vectorized_outcome_advantage(
        scores, b["mask"], labels, norm_adv_by_std_in_grpo=norm_by_std
    )
    assert_matches_verl("grpo_advantages (verl loop)", ours, loop)
    assert_matches_verl("grpo_advantages (verl vectorized)", ours, vectorized)
    assert torch.equal(ours, ours_ret)


@pytest.mark.parametrize("shape", [(3, 5, 7), (8, 16, 97), (2, 1, 1000)])
def test_entropy_matches_verl(shape) -> None:
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(12)) * 4
    assert_matches_verl("entropy_from_logits", algo.entropy_from_logits(logits), verl_F.entropy_from_logits(logits))


def test_masked_whiten_matches_verl() -> None:
    b = make_batch(16, 33, seed=13)
    assert_matches_verl(
        "masked_whiten", algo.masked_whiten(b["values"], b["mask"]), verl_F.masked_whiten(b["values"], b["mask"])
    )
    assert_matches_verl(
        "masked_var", algo.masked_var(b["values"], b["mask"]), verl_F.masked_var(b["values"], b["mask"])
    )


def test_kl_in_reward_matches_verl_compute_rewards() -> None:
    b = make_batch(16, 33, seed=14)
    kl = algo.kl_penalty(b["old_log_prob"], b["ref_log_prob"], "k1") * b["mask"]
    ours = algo.kl_penalized_rewards(b["rewards"], kl, 0.05, b["mask"])
    theirs = verl.compute_rewards(b["rewards"], b["old_log_prob"] * b["mask"], b["ref_log_prob"] * b["mask"], 0.05)
    assert_matches_verl("kl_penalized_rewards", ours, theirs)


@pytest.mark.parametrize(("init", "target", "horizon"), [(0.001, 0.1, 10000), (0.2, 6.0, 500), (0.05, 0.01, 64)])
def test_adaptive_controller_trajectory_matches_verl(init: float, target: float, horizon: int) -> None:
    ours = algo.AdaptiveKLController(init, target, horizon)
    theirs = verl.AdaptiveKLController(init, target, horizon)
    kls = torch.rand(300, generator=torch.Generator().manual_seed(15)).mul(3 * target).tolist()
    for step, kl in enumerate(kls):
        ours.update(kl, n_steps=256)
        theirs.update(kl, n_steps=256)
        assert_matches_verl("AdaptiveKLController trajectory", ours.value, theirs.value, tol=1e-12)
        assert ours.value == pytest.approx(theirs.value, rel=1e-12), f"step {step}"
