"""Advantage estimators, registered by verl's names (`algorithm.adv_estimator`). Token tensors are
`[batch, response_len]` (or wider, with zero mask off the response); rewards sit on response tokens.

Every entry has verl 0.9.1's arguments in verl's order and takes the others by keyword (`**kwargs`), so the trainer
calls each with the same keywords: `token_level_rewards`, `response_mask`, `index` (the rows' group labels),
`values` (GAE), `gamma`, `lam`, `norm_adv_by_std_in_grpo` and `config` (any object with verl's `AlgoConfig`
attributes: `gamma`, `norm_adv_by_std_in_grpo`). Each returns `(advantages, returns)`.
Estimators that need what offline rows do not carry are in `ROLLOUT_ONLY_ESTIMATORS`, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from megatron_ppo.algo.masked import masked_whiten
from megatron_ppo.algo.registry import registrar

AdvantageFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]
ADV_ESTIMATORS: dict[str, AdvantageFn] = {}
# The estimators that compare the responses of one prompt (`grouped=True` where registered: they read `index`):
# batches hold whole groups.
GROUPED_ESTIMATORS: set[str] = set()
# verl's estimators that cannot run on offline rows, with what they lack.
ROLLOUT_ONLY_ESTIMATORS = {
    "remax": "ReMax's baseline is the reward of a greedy response sampled for each prompt during rollout "
    "(reward_baselines); offline rows carry none — use rloo or grpo",
    "gdpo": "GDPO reads per-reward-component rollout fields (non_tensor_batch) that offline rows do not have",
    "optimal_token_baseline": "it needs Σπ² over the vocabulary at every response token from the actor's forward "
    "pass (verl's actor.calculate_sum_pi_squared), which the experience pass does not compute",
    "tir_optimal_token_baseline": "multi-turn tool rollouts; see optimal_token_baseline",
}


# Decorator: the function becomes `ADV_ESTIMATORS[name]` (a new entry is one decorated function).
register_adv_est = registrar(ADV_ESTIMATORS, "advantage estimator", {"grouped": GROUPED_ESTIMATORS})


def get_adv_estimator_fn(name: str) -> AdvantageFn:
    """The registered estimator `name`; an unknown or rollout-only name raises with the reason."""
    if name in ROLLOUT_ONLY_ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} cannot run offline: {ROLLOUT_ONLY_ESTIMATORS[name]}")
    if name not in ADV_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; expected one of {', '.join(ADV_ESTIMATORS)}")
    return ADV_ESTIMATORS[name]


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


@register_adv_est("grpo", grouped=True)
@torch.no_grad()
def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
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


@register_adv_est("gae")
def gae_estimator(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The registry's GAE: `gae_advantages` with whitened advantages (as verl)."""
    return gae_advantages(token_level_rewards, values, response_mask, gamma, lam)


def _group_stats(scores: torch.Tensor, index: Sequence[Hashable] | torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row: its group's dense id, size n_g and mean score (0 for a group of one, as verl)."""
    group = _group_ids(index, scores.device)
    num_groups = int(group.max()) + 1 if group.numel() else 0
    counts = torch.zeros(num_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, group, torch.ones_like(scores)
    )
    mean = torch.zeros_like(counts).index_add_(0, group, scores) / counts
    mean = torch.where(counts == 1, 0.0, mean)
    return group, counts[group], mean[group]


@register_adv_est("rloo", grouped=True)
@torch.no_grad()
def rloo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): each response against the mean of the others in its group,

        A_i = s_i·n/(n − 1) − mean_g·n/(n − 1) = s_i − mean_{g∖i}      (A_i = s_i in a group of one)

    broadcast over the response tokens; returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    _, n, mean = _group_stats(scores, index)
    several = n > 1
    factor = torch.where(several, n / (n - 1).clamp(min=1), 1.0)
    scalars = torch.where(several, scores * factor - mean * factor, scores)
    advantages = scalars.unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus_baseline", grouped=True)
@torch.no_grad()
def reinforce_plus_plus_baseline_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline (Hu 2025, arXiv 2501.03262): A = whiten_batch(s_i − mean_g) over the response
    tokens (mean 0 in a group of one); returns = advantages."""
    scores = token_level_rewards.sum(dim=-1)
    _, _, mean = _group_stats(scores, index)
    centred = (scores - mean).unsqueeze(-1).expand_as(response_mask) * response_mask
    advantages = masked_whiten(centred, response_mask) * response_mask
    return advantages, advantages


@register_adv_est("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus_advantages(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, config: Any = None, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025): discounted return-to-go over response tokens, whitened over the batch,

        G_t = r_t + γ·G_{t+1}  (masked tokens pass G through),   A = whiten(G) · m

    with γ = `config.gamma`. Returns (A, G·m).
    """
    gamma = config.gamma
    returns = torch.zeros_like(token_level_rewards)
    running = torch.zeros_like(token_level_rewards[:, 0])
    for t in reversed(range(token_level_rewards.shape[1])):
        mask_t = response_mask[:, t]
        new_running = token_level_rewards[:, t] + gamma * running
        returns[:, t] = new_running * mask_t
        running = new_running * mask_t + running * (1 - mask_t)
    advantages = masked_whiten(returns, response_mask) * response_mask
    return advantages, returns


@register_adv_est("opo", grouped=True)
@torch.no_grad()
def opo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy RL with the optimal baseline (arXiv 2505.23585): a length-weighted group mean,

        b_g = Σ_{j∈g} |y_j|·s_j / Σ_{j∈g} |y_j|   (0 in a group of one),   A_i = s_i − b_g

    broadcast over the response tokens; returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    lengths = response_mask.sum(dim=-1)
    group, n, _ = _group_stats(scores, index)
    weighted = torch.zeros(int(group.max()) + 1 if group.numel() else 0, dtype=scores.dtype, device=scores.device)
    total_length = torch.zeros_like(weighted).index_add_(0, group, lengths.to(scores.dtype))
    baseline = weighted.index_add_(0, group, lengths * scores)[group] / total_length[group]
    baseline = torch.where(n == 1, 0.0, baseline)
    advantages = (scores - baseline).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("gpg", grouped=True)
@torch.no_grad()
def gpg_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    f_norm: float = 1.0,
    alpha: float = 1.0,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG (arXiv 2504.02546): group-centred scores rescaled by the share of rows with a non-zero score,

        α = B / max(#{i: s_i ≠ 0}, 1),   A_i = α·(s_i − mean_g) / f_norm      (mean 0 in a group of one)

    The `alpha` argument is overwritten by this α (as in verl). Returns = advantages.
    """
    scores = token_level_rewards.sum(dim=-1)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    _, _, mean = _group_stats(scores, index)
    advantages = (alpha * (scores - mean) / f_norm).unsqueeze(-1) * response_mask
    return advantages, advantages


@register_adv_est("grpo_passk", grouped=True)
@torch.no_grad()
def grpo_passk_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Hashable] | torch.Tensor,
    epsilon: float = 1e-6,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k training (arXiv 2503.19595): only the best response of each group gets an advantage,

        A_best = (s_max − s_second) / (std_g + ε)   (or without the division when not `norm_adv_by_std_in_grpo`)

    and every other response 0. `config.norm_adv_by_std_in_grpo` wins over the argument, as in verl. A group of
    fewer than two responses raises.
    """
    if config is not None:
        norm_adv_by_std_in_grpo = getattr(config, "norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    group = _group_ids(index, scores.device)
    for g in range(int(group.max()) + 1 if group.numel() else 0):
        rows = torch.nonzero(group == g, as_tuple=True)[0]
        if rows.numel() < 2:
            raise ValueError(f"grpo_passk needs at least 2 responses per group; group {g} has {rows.numel()}")
        rewards = scores[rows]
        top, top_index = torch.topk(rewards, 2)
        advantage = top[0] - top[1]
        if norm_adv_by_std_in_grpo:
            advantage = advantage / (torch.std(rewards) + epsilon)
        advantages[rows[top_index[0]]] = advantage
    advantages = advantages.unsqueeze(-1) * response_mask
    return advantages, advantages


def _group_ids(index: Sequence[Hashable] | torch.Tensor, device: torch.device) -> torch.Tensor:
    """Map arbitrary group labels to dense ids 0..G−1."""
    if isinstance(index, torch.Tensor):
        return torch.unique(index, return_inverse=True)[1].to(device)
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(label, len(dense)) for label in index], dtype=torch.long, device=device)
