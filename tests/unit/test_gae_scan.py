"""The scan-based GAE (`algo.gae_advantages`) against the per-token loop it replaced and verl's
`compute_gae_advantage_return`: masks with gaps and empty rows, up to 4096 response tokens. In float64 the two
agree to 1e-10; in float32 the loop's own rounding (its carries are running sums) bounds the agreement."""

from __future__ import annotations

import pytest
import torch
from verl.trainer.ppo.core_algos import compute_gae_advantage_return

from megatron_ppo import algo


def loop_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float):
    """The per-token loop `gae_advantages` ran before the scan (not whitened)."""
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.empty_like(values)
    for t in reversed(range(values.shape[-1])):
        mask_t = mask[:, t].to(values.dtype)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        next_value = values[:, t] * mask_t + (1 - mask_t) * next_value
        next_advantage = advantage_t * mask_t + (1 - mask_t) * next_advantage
        advantages[:, t] = next_advantage
    return advantages, advantages + values


def batch(rows: int, width: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """Right-padded responses of random lengths (one empty row), a gap of masked tokens inside row 1, dense
    random rewards on the mask and values everywhere (padding values must not leak in)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[0] = 0
    mask = (torch.arange(width) < lengths[:, None]).to(dtype)
    mask[1, width // 3 : width // 2] = 0
    rewards = torch.randn(rows, width, generator=gen, dtype=dtype) * mask
    values = torch.randn(rows, width, generator=gen, dtype=dtype)
    return rewards, values, mask


def assert_close(name: str, ours: torch.Tensor, theirs: torch.Tensor, tol: float) -> None:
    """max |ours − theirs| ≤ tol·max(1, max |theirs|): relative to the largest value, the measure of a float32
    loop's rounding, which grows with the running sums it carries (A_t sums up to T terms)."""
    diff = float((ours.double() - theirs.double()).abs().max())
    allowed = tol * max(1.0, float(theirs.double().abs().max()))
    assert diff <= allowed, f"{name}: largest difference {diff:.3e} (allowed {allowed:.3e})"


SHAPES = [(3, 1), (6, 7), (8, 300), (4, 4096)]
GAMMA_LAMBDA = [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.5, 0.0)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAMBDA)
def test_scan_gae_equals_the_token_loop_exactly_in_float64(shape, gamma: float, lam: float) -> None:
    rewards, values, mask = batch(*shape, torch.float64, seed=shape[1])
    advantages, returns = algo.gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    loop_advantages, loop_returns = loop_gae(rewards, values, mask, gamma, lam)
    assert_close("advantages", advantages, loop_advantages, 1e-10)
    assert_close("returns", returns, loop_returns, 1e-10)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("gamma", "lam"), GAMMA_LAMBDA)
def test_scan_gae_matches_the_loop_and_verl_in_float32(shape, gamma: float, lam: float) -> None:
    rewards, values, mask = batch(*shape, torch.float32, seed=shape[1])
    advantages, returns = algo.gae_advantages(rewards, values, mask, gamma, lam, whiten=False)
    assert advantages.dtype == returns.dtype == torch.float32
    loop_advantages, loop_returns = loop_gae(rewards, values, mask, gamma, lam)
    assert_close("advantages against the loop", advantages, loop_advantages, 1e-6)
    assert_close("returns against the loop", returns, loop_returns, 1e-6)
    whitened, _ = algo.gae_advantages(rewards, values, mask, gamma, lam)
    verl_advantages, verl_returns = compute_gae_advantage_return(rewards, values, mask, gamma, lam)
    assert_close("whitened advantages against verl", whitened, verl_advantages, 1e-6)
    assert_close("returns against verl", returns, verl_returns, 1e-6)
