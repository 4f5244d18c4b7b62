"""Critic objective and its diagnostics. All tensors `[batch, response_len]`."""

from __future__ import annotations

import torch

from megatron_ppo.algo.aggregation import agg_loss
from megatron_ppo.algo.masked import masked_mean


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss: ½ · agg(max((V − R)², (V_clip − R)²)), V_clip = clip(V, V_old − ε_v, V_old + ε_v).

    Returns (loss, clipfrac) where clipfrac is the share of tokens whose clipped error is the larger one.
    """
    vpred_clipped = torch.clamp(vpreds, values - cliprange_value, values + cliprange_value)
    unclipped = (vpreds - returns).square()
    clipped = (vpred_clipped - returns).square()
    loss = 0.5 * agg_loss(
        torch.maximum(unclipped, clipped),
        response_mask,
        loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
    return loss, clipfrac


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1 − Var(R − V) / (Var(R) + 1e-5) over response tokens (verl's `critic/vf_explained_var`); NaN if empty."""
    valid = response_mask.bool()
    if not valid.any():
        return torch.tensor(float("nan"))
    valid_returns = returns[valid]
    return 1.0 - torch.var(valid_returns - values[valid]) / (torch.var(valid_returns) + 1e-5)
