"""The algorithm core against closed forms and the properties its equations promise."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_ppo import algo


def _nearby_categoricals(seed: int, vocab: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """A policy and a reference a PPO step apart (KL of a few hundredths of a nat)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen)
    return logits, logits + 0.3 * torch.randn(vocab, generator=gen)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_k1_and_k3_are_unbiased_and_k3_has_lower_variance(seed: int) -> None:
    logits, ref_logits = _nearby_categoricals(seed)
    exact = algo.kl_from_logits(logits, ref_logits).item()
    policy = torch.distributions.Categorical(logits=logits)
    tokens = torch.multinomial(policy.probs, 200_000, replacement=True, generator=torch.Generator().manual_seed(seed))
    log_prob = policy.log_prob(tokens)
    ref_log_prob = torch.distributions.Categorical(logits=ref_logits).log_prob(tokens)
    k1 = algo.kl_penalty(log_prob, ref_log_prob, "k1")
    k3 = algo.kl_penalty(log_prob, ref_log_prob, "k3")
    stderr = k1.std().item() / math.sqrt(tokens.numel())
    assert abs(k1.mean().item() - exact) < 5 * stderr, f"k1 mean {k1.mean():.5f} vs exact KL {exact:.5f}"
    assert abs(k3.mean().item() - exact) < 5 * stderr, f"k3 mean {k3.mean():.5f} vs exact KL {exact:.5f}"
    assert k3.var() < k1.var(), f"k3 variance {k3.var():.4f} should be below k1's {k1.var():.4f}"
    assert (k3 >= 0).all(), "k3 = r − log r − 1 is never negative"


def test_kl_from_logits_equals_torch_kl_divergence() -> None:
    logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(0)) * 3
    ref_logits = torch.randn(3, 5, 17, generator=torch.Generator().manual_seed(1))
    expected = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=logits), torch.distributions.Categorical(logits=ref_logits)
    )
    torch.testing.assert_close(algo.kl_from_logits(logits, ref_logits), expected, atol=1e-5, rtol=1e-5)
    assert algo.kl_from_logits(logits, logits).abs().max() < 1e-6


def test_straight_through_kl_has_value_of_kind_and_gradient_of_k2() -> None:
    log_prob = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    ref_log_prob = torch.tensor([-1.5, -1.0, -0.5])
    value = algo.kl_penalty(log_prob, ref_log_prob, "k3+")
    torch.testing.assert_close(value.detach(), algo.kl_penalty(log_prob.detach(), ref_log_prob, "k3"))
    value.sum().backward()
    torch.testing.assert_close(log_prob.grad, (log_prob - ref_log_prob).detach())


def test_unknown_kl_kind_names_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="low_var_kl"):
        algo.kl_penalty(torch.zeros(2), torch.zeros(2), "k4")


def _one_token(advantage: float, log_ratio: float, **kwargs) -> float:
    mask = torch.ones(1, 1)
    config = algo.PolicyLossConfig(
        clip_ratio_low=kwargs.get("low", 0.2),
        clip_ratio_high=kwargs.get("high", 0.28),
        clip_ratio_c=kwargs.get("c", 3.0),
    )
    loss, _ = algo.get_policy_loss_fn("vanilla")(
        torch.zeros(1, 1), torch.full((1, 1), log_ratio), torch.full((1, 1), advantage), mask, "token-sum", config
    )
    return loss.item()


@pytest.mark.parametrize("log_ratio", [2.0, 5.0, 19.0, 40.0])
def test_dual_clip_caps_negative_advantage_loss(log_ratio: float) -> None:
    advantage, c = -1.5, 3.0
    assert _one_token(advantage, log_ratio, c=c) == pytest.approx(-advantage * c)


def test_asymmetric_clip_bounds_the_ratio_on_each_side() -> None:
    # A > 0: the gain stops growing at ρ = 1 + high;  A < 0: the loss stops falling at ρ = 1 − low
    assert _one_token(1.0, math.log(2.0), low=0.2, high=0.28) == pytest.approx(-1.28)
    assert _one_token(-1.0, math.log(0.5), low=0.2, high=0.28) == pytest.approx(0.8)
    assert _one_token(1.0, math.log(1.1), low=0.2, high=0.28) == pytest.approx(-1.1)


def test_dual_clip_needs_c_above_one() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _one_token(1.0, 0.0, c=1.0)


def test_gae_with_gamma_lambda_one_is_reward_to_go_minus_value() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(5, 9, generator=gen), torch.randn(5, 9, generator=gen)
    mask = (torch.arange(9)[None, :] < torch.tensor([9, 4, 1, 7, 2])[:, None]).float()
    advantages, returns = algo.gae_advantages(rewards * mask, values, mask, gamma=1.0, lam=1.0, whiten=False)
    reward_to_go = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
    torch.testing.assert_close(advantages * mask, (reward_to_go - values) * mask)
    torch.testing.assert_close(returns * mask, reward_to_go * mask)


def test_gae_discounts_by_gamma_lambda() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.zeros(1, 3)
    advantages, _ = algo.gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.5, whiten=False)
    torch.testing.assert_close(advantages, torch.tensor([[0.45**2, 0.45, 1.0]]))


@settings(max_examples=25, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 12), min_size=4, max_size=12).filter(any),
    mode=st.sampled_from(tuple(algo.LOSS_AGGREGATIONS)),
    splits=st.integers(2, 4),
)
def test_micro_batch_losses_with_global_counts_sum_to_the_mini_batch_loss(lengths, mode, splits) -> None:
    """Normalising each micro-batch by its own count would re-weight tokens; by the global count it must not."""
    mask = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).float()
    loss_mat = torch.randn(mask.shape, generator=torch.Generator().manual_seed(sum(lengths)))
    whole = algo.agg_loss(loss_mat, mask, mode, loss_scale_factor=12)
    counts = {"batch_num_tokens": mask.sum(), "global_batch_size": (mask.sum(-1) > 0).sum().clamp(min=1)}
    parts = sum(
        algo.agg_loss(m, k, mode, loss_scale_factor=12, **counts)
        for m, k in zip(loss_mat.chunk(splits), mask.chunk(splits), strict=True)
    )
    torch.testing.assert_close(parts, whole, atol=1e-5, rtol=1e-5)


def test_value_loss_clips_against_old_values() -> None:
    mask = torch.ones(1, 2)
    values, returns = torch.tensor([[0.0, 0.0]]), torch.tensor([[1.0, -1.0]])
    vpreds = torch.tensor([[2.0, 0.1]])  # first overshoots the clip range, second stays inside it
    loss, clipfrac = algo.value_loss(vpreds, returns, values, mask, cliprange_value=0.5, loss_agg_mode="token-sum")
    # token 0: max((2−1)², (0.5−1)²) = 1;  token 1: max((0.1+1)², (0.1+1)²) = 1.21
    assert loss.item() == pytest.approx(0.5 * (1.0 + 1.21))
    assert clipfrac.item() == 0.0


def test_explained_variance_is_one_for_perfect_values_and_zero_for_mean() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    assert algo.explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert algo.explained_variance(torch.full_like(returns, 2.5), returns, mask).item() == pytest.approx(0.0, abs=1e-4)
    assert math.isnan(algo.explained_variance(returns, returns, torch.zeros(1, 4)).item())


def test_entropy_of_uniform_is_log_vocab() -> None:
    assert algo.entropy_from_logits(torch.zeros(2, 50)).tolist() == pytest.approx([math.log(50)] * 2)


def test_scores_go_on_the_last_response_token() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    token_scores = algo.scores_to_token_level(torch.tensor([1.0, -2.0, 0.5]), mask)
    assert token_scores.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, -2.0], [0.5, 0.0, 0.0]]


def test_empty_response_is_an_error_not_a_lost_reward() -> None:
    with pytest.raises(ValueError, match=r"rows \[1\]"):
        algo.scores_to_token_level(torch.tensor([1.0, 2.0]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]))


def test_kl_in_reward_subtracts_beta_kl_on_response_tokens_only() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    rewards = algo.kl_penalized_rewards(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.5, 0.2, 9.0]]), 0.1, mask)
    torch.testing.assert_close(rewards, torch.tensor([[-0.05, 0.98, 0.0]]))


def test_reward_clipping() -> None:
    assert algo.clip_rewards(torch.tensor([-5.0, 0.5, 3.0]), (-2.0, 2.0)).tolist() == [-2.0, 0.5, 2.0]
    assert algo.clip_rewards(torch.tensor([-5.0]), None).tolist() == [-5.0]


def test_running_normalizer_equals_statistics_of_all_batches_and_round_trips() -> None:
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randn(n, generator=gen) * 3 + 1 for n in (5, 17, 1, 40)]
    normalizer = algo.RunningRewardNormalizer()
    for batch in batches:
        normalizer.update(batch)
    everything = torch.cat(batches).double()
    assert normalizer.mean == pytest.approx(everything.mean().item())
    assert normalizer.var == pytest.approx(everything.var(unbiased=False).item())
    restored = algo.RunningRewardNormalizer()
    restored.load_state_dict(normalizer.state_dict())
    probe = torch.tensor([0.0, 4.0])
    assert torch.equal(restored.normalize(probe), normalizer.normalize(probe))
    assert normalizer.normalize(everything).mean().abs() < 1e-9


def test_grpo_singleton_group_keeps_its_score_and_groups_are_centred() -> None:
    scores = torch.zeros(5, 2)
    scores[:, -1] = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0])
    advantages, _ = algo.grpo_advantages(scores, torch.ones(5, 2), ["a", "a", "b", "b", "solo"])
    per_seq = advantages[:, 0]
    assert per_seq[:4].tolist() == pytest.approx([0.7071, -0.7071, 0.7071, -0.7071], abs=1e-3)
    assert per_seq[4].item() == pytest.approx(2.0, abs=1e-5)


def test_truncated_is_weights_cap_and_zero_padding() -> None:
    log_prob = torch.tensor([[0.0, 0.0, 0.0]])
    behavior = torch.tensor([[-5.0, 0.5, 0.0]])
    weights, _ = algo.compute_rollout_correction_weights(
        log_prob - behavior, torch.tensor([[1.0, 1.0, 0.0]]), "token", 2.0
    )
    torch.testing.assert_close(weights, torch.tensor([[2.0, math.exp(-0.5), 0.0]]))


def test_grouped_estimators_are_registered_as_those_reading_the_group_index() -> None:
    """`grouped=True` at registration (batches hold whole groups for these) says what each function's signature
    says: it reads `index`, the prompt each response answers."""
    import inspect

    reads_index = {name for name, fn in algo.ADV_ESTIMATORS.items() if "index" in inspect.signature(fn).parameters}
    assert reads_index == algo.GROUPED_ESTIMATORS
    assert {"grpo", "rloo"} <= algo.GROUPED_ESTIMATORS and "gae" not in algo.GROUPED_ESTIMATORS


def test_a_registration_refuses_a_fact_its_registry_does_not_keep() -> None:
    from megatron_ppo.algo.registry import registrar

    register = registrar({}, "probe", {"grouped": set()})
    with pytest.raises(TypeError, match="no fact"):
        register("x", sequence_level=True)
