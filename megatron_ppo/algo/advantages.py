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
    """
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.empty_like(values)
    for t in reversed(range(values.shape[-1])):
        mask_t = response_mask[:, t].to(values.dtype)
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = delta + gamma * lam * next_advantage
        next_value = values[:, t] * mask_t + (1 - mask_t) * next_value
        next_advantage = advantage_t * mask_t + (1 - mask_t) * next_advantage
        advantages[:, t] = next_advantage
    returns = advantages + values
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


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
