"""Advantage estimators. Token tensors are `[batch, response_len]`; rewards sit on response tokens."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from megatron_ppo.algo.masked import masked_whiten


@torch.no_grad()
def gae_advantages(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    whiten: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), backwards over response tokens:

        δ_t = r_t + γ·V_{t+1} − V_t,     A_t = δ_t + γ·λ·A_{t+1},     R_t = A_t + V_t

    where "t+1" is the next *unmasked* token (masked positions pass V and A through unchanged). Returns
    (advantages, returns); advantages are whitened over the mask when `whiten` (verl always whitens).

    With m_t the mask, both carries are first-order linear recurrences over t, x_t = c_t·x_{t+1} + b_t, x_T = 0:

        V̂_t = (1 − m_t)·V̂_{t+1} + m_t·V_t                        (the value at the next unmasked token)
        Â_t = (1 − m_t + m_t·γλ)·Â_{t+1} + m_t·(r_t + γ·V̂_{t+1} − V_t)    (advantages: Â)

    each solved by a reverse scan in ⌈log₂ T⌉ steps (`_reverse_linear_scan`), in float64, instead of T steps of a
    Python loop (about 8 kernel launches per token on a GPU); equal to verl's loop to float32 rounding.
    """
    dtype = values.dtype
    mask = response_mask.to(torch.float64)
    value, reward = values.to(torch.float64), token_level_rewards.to(torch.float64)
    next_value = _shift_left(_reverse_linear_scan(1 - mask, mask * value))
    delta = reward + gamma * next_value - value
    advantages = _reverse_linear_scan(1 - mask + mask * (gamma * lam), mask * delta).to(dtype)
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


def _shift_left(x: torch.Tensor, by: int = 1) -> torch.Tensor:
    """y_t = x_{t+by} along the last axis, 0 past its end."""
    return torch.nn.functional.pad(x[..., by:], (0, min(by, x.shape[-1])))


def _reverse_linear_scan(coefficient: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x_t = c_t·x_{t+1} + b_t for every t along the last axis `[..., T]`, with x_T = 0 (so x_{T−1} = b_{T−1}).

    A Hillis–Steele scan of the affine maps x ↦ c·x + b, composed as (c, b)_t ∘ (c, b)_{t+d} =
    (c_t·c_{t+d}, b_t + c_t·b_{t+d}): after the step with distance d = 1, 2, 4, … each position holds the map
    over its next 2d tokens, so ⌈log₂ T⌉ steps (a few tensor operations each) solve the whole recurrence.
    No division by c (which may be 0) and no product longer than the recurrence's own (no under- or overflow
    beyond that of the result).
    """
    c, b = coefficient, offset
    distance = 1
    while distance < b.shape[-1]:
        b = b + c * _shift_left(b, distance)
        c = c * _shift_left(c, distance)
        distance *= 2
    return b


@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative outcome advantage (GRPO): for response i of group g with score s_i = Σ_t r_{i,t},

        A_i = (s_i − mean_g) / (std_g + ε)     (or s_i − mean_g when not `norm_adv_by_std_in_grpo`, Dr.GRPO)

    broadcast over the response tokens. std is unbiased (n−1); a group of one has mean 0 and std 1 (as in verl).
    Returns (advantages, returns), equal here.
    """
    scores = token_level_rewards.sum(dim=-1)
    group = _group_ids(index, scores.device)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, group, torch.ones_like(scores)
    )
    sums = torch.zeros_like(counts).index_add_(0, group, scores)
    mean = sums / counts
    sq_dev = torch.zeros_like(counts).index_add_(0, group, (scores - mean[group]).square())
    std = torch.sqrt(sq_dev / (counts - 1).clamp(min=1))
    singleton = counts == 1
    mean = torch.where(singleton, 0.0, mean)
    std = torch.where(singleton, 1.0, std)
    centered = scores - mean[group]
    scalars = centered / (std[group] + epsilon) if norm_adv_by_std_in_grpo else centered
    advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


def _group_ids(index: Sequence[Hashable] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Map arbitrary group labels to dense ids 0..G−1."""
    if isinstance(index, torch.Tensor):
        return torch.unique(index, return_inverse=True)[1].to(device)
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(label, len(dense)) for label in index], dtype=torch.long, device=device)
