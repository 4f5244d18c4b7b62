"""Clipped PPO surrogate for the actor, with asymmetric and dual clipping (verl's "vanilla" policy loss)."""

from __future__ import annotations

import torch

from megatron_ppo.algo.aggregation import agg_loss
from megatron_ppo.algo.masked import masked_mean, masked_sum

_LOG_RATIO_CLAMP = 20.0


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip loss per token, then aggregated; all tensors `[batch, response_len]`.

        ρ      = exp(clamp(log π − log π_old, ±20))
        ℓ_clip = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))
        ℓ      = min(ℓ_clip, −A·c)  where A < 0  (dual clip, c = clip_ratio_c > 1: the loss of a negative-advantage
                                                  token is capped at −A·c however large ρ grows)
        ℓ      = ℓ_clip             where A ≥ 0
        ℓ      = ℓ · w              with truncated importance weights w against the behaviour policy, if given

    Metrics (detached scalars): `pg_clipfrac` (share of tokens where the clipped branch is active), `pg_clipfrac_lower`
    (share capped by the dual clip), `ppo_kl` (masked mean of log π_old − log π).
    """
    if clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {clip_ratio_c}")
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)

    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    if is_weights is not None:
        pg_losses = pg_losses * is_weights

    loss = agg_loss(
        pg_losses,
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "pg_clipfrac_lower": masked_mean(((clip_loss > dual_cap) & negative).float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
        }
    return loss, metrics


def truncated_is_weights(
    log_prob: torch.Tensor,
    behavior_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> torch.Tensor:
    """Truncated importance weights w = min(π/μ, cap) against the behaviour policy μ that produced the data.

    level "token":    w_t = min(exp(clamp(log π_t − log μ_t, ±20)), cap)
    level "sequence": w   = min(exp(clamp(Σ_t m_t (log π_t − log μ_t), ±20)), cap), broadcast over the sequence
    Padding tokens get weight 0. Detached: the weights rescale the loss, they are not optimised (verl's TIS).
    """
    with torch.no_grad():
        log_ratio = log_prob - behavior_log_prob
        if level == "sequence":
            log_ratio = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1).expand_as(log_prob)
        elif level != "token":
            raise ValueError(f"unknown importance-weight level {level!r}; expected 'token' or 'sequence'")
        weights = torch.exp(torch.clamp(log_ratio, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)) * response_mask
        return weights.clamp(max=cap)
