"""Reduce a per-token loss matrix `[batch, response_len]` to the scalar that is back-propagated.

The normaliser is the token (or sequence) count of the whole mini-batch — all micro-batches on all
data-parallel ranks — not of the micro-batch in hand. Normalising per micro-batch silently re-weights tokens
(and so rescales the learning rate) whenever micro-batches differ in length. Each micro-batch's loss is
therefore `Σ_local / N_global × dp_size`: data-parallel gradient averaging divides by `dp_size` again, and summing
micro-batch gradients then yields exactly `Σ_global / N_global`. (Megatron's pipeline schedule also divides each
micro-batch loss by the number of micro-batches; the trainer undoes that.)

Modes (names from verl):
    token-mean               Σ_{i,t} m·ℓ / N_tokens
    token-sum                Σ_{i,t} m·ℓ
    seq-mean-token-sum       Σ_i (Σ_t m·ℓ) / N_seqs
    seq-mean-token-mean      Σ_i (Σ_t m·ℓ / Σ_t m) / N_seqs
    seq-mean-token-sum-norm  Σ_i (Σ_t m·ℓ) / N_seqs / loss_scale_factor   (default factor: response_len)
Sequences with no unmasked token count in no mean.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_ppo.algo.masked import masked_sum
from megatron_ppo.algo.registry import registrar

Count = int | float | torch.Tensor | None
Aggregation = Callable[[torch.Tensor, torch.Tensor, int, Count, Count, Count], torch.Tensor]
LOSS_AGGREGATIONS: dict[str, Aggregation] = {}


# Decorator: the function becomes `LOSS_AGGREGATIONS[name]` (a new entry is one decorated function).
register_agg = registrar(LOSS_AGGREGATIONS, "loss_agg_mode")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Count = None,
    global_batch_size: Count = None,
    loss_scale_factor: Count = None,
) -> torch.Tensor:
    """Aggregate `loss_mat` under `loss_mask` by `loss_agg_mode` (see module docstring).

    `batch_num_tokens` / `global_batch_size`: valid tokens / non-empty sequences of the whole mini-batch across
    micro-batches and data-parallel ranks; when omitted the local counts are used (only allowed at dp_size 1).
    """
    if loss_agg_mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {', '.join(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS[loss_agg_mode](
        loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
    )


@register_agg("token-mean")
def token_mean(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) -> torch.Tensor:
    """Σ m·ℓ / N_tokens × dp_size."""
    if batch_num_tokens is None:
        _require_local(dp_size, "batch_num_tokens")
        batch_num_tokens = loss_mask.sum()
    return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size


@register_agg("token-sum")
def token_sum(loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) -> torch.Tensor:
    """Σ m·ℓ × dp_size."""
    return masked_sum(loss_mat, loss_mask) * dp_size


def _seq_mean(
    seq_losses: torch.Tensor, loss_mask: torch.Tensor, dp_size: int, global_batch_size: Count
) -> torch.Tensor:
    non_empty = (loss_mask.sum(dim=-1) > 0).to(seq_losses.dtype)
    if global_batch_size is None:
        _require_local(dp_size, "global_batch_size")
        global_batch_size = non_empty.sum()
    return masked_sum(seq_losses, non_empty) / global_batch_size * dp_size


@register_agg("seq-mean-token-sum")
def seq_mean_token_sum(
    loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
) -> torch.Tensor:
    """Σ_i (Σ_t m·ℓ) / N_seqs × dp_size."""
    return _seq_mean(masked_sum(loss_mat, loss_mask, dim=-1), loss_mask, dp_size, global_batch_size)


@register_agg("seq-mean-token-mean")
def seq_mean_token_mean(
    loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
) -> torch.Tensor:
    """Σ_i (Σ_t m·ℓ / Σ_t m) / N_seqs × dp_size."""
    seq_losses = masked_sum(loss_mat, loss_mask, dim=-1) / (loss_mask.sum(dim=-1) + 1e-8)
    return _seq_mean(seq_losses, loss_mask, dp_size, global_batch_size)


@register_agg("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(
    loss_mat, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor
) -> torch.Tensor:
    """seq-mean-token-sum / loss_scale_factor (default: the width of `loss_mask`)."""
    loss = _seq_mean(masked_sum(loss_mat, loss_mask, dim=-1), loss_mask, dp_size, global_batch_size)
    return loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)


def _require_local(dp_size: int, name: str) -> None:
    if dp_size > 1:
        raise ValueError(f"{name} (the count over the whole mini-batch) is required when dp_size={dp_size} > 1")
