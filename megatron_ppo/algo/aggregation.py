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

import torch

from megatron_ppo.algo.masked import masked_sum

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate `loss_mat` under `loss_mask` by `loss_agg_mode` (see module docstring).

    `batch_num_tokens` / `global_batch_size`: valid tokens / non-empty sequences of the whole mini-batch across
    micro-batches and data-parallel ranks; when omitted the local counts are used (only allowed at dp_size 1).
    """
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            _require_local(dp_size, "batch_num_tokens")
            batch_num_tokens = loss_mask.sum()
        return masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask) * dp_size
    if loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        tokens_per_seq = loss_mask.sum(dim=-1)
        seq_losses = masked_sum(loss_mat, loss_mask, dim=-1)
        if loss_agg_mode == "seq-mean-token-mean":
            seq_losses = seq_losses / (tokens_per_seq + 1e-8)
        non_empty = (tokens_per_seq > 0).to(loss_mat.dtype)
        if global_batch_size is None:
            _require_local(dp_size, "global_batch_size")
            global_batch_size = non_empty.sum()
        loss = masked_sum(seq_losses, non_empty) / global_batch_size * dp_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            loss = loss / (loss_mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")


def _require_local(dp_size: int, name: str) -> None:
    if dp_size > 1:
        raise ValueError(f"{name} (the count over the whole mini-batch) is required when dp_size={dp_size} > 1")
