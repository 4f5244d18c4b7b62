"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary, `[batch, seq, vocab / TP]`. The softmax
normaliser is assembled from per-rank pieces, so no rank ever holds a `[tokens, vocab]` tensor:

    z = logits / T,   m = max_v z (all-reduce MAX, no gradient),   S = Σ_v exp(z_v − m) (all-reduce SUM)
    log p(y) = z_y − m − log S          (z_y taken on the rank that owns y, then all-reduce SUM)
    H        = log S − Σ_v p_v (z_v − m)

The sums use Megatron's `reduce_from_tensor_model_parallel_region` (all-reduce forward, identity backward): every
TP rank computes the same loss from the reduced values, so each rank's gradient flows to its own slice.
Columns at or beyond the true vocabulary size (padding for TP divisibility) are excluded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(label) `[batch, seq]` and, if asked, the entropy `[batch, seq]`, from this rank's logits slice."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    local_vocab = logits.shape[-1]
    start = tp_rank * local_vocab

    z = logits.float() / temperature
    padding = None
    if vocab_size is not None and start + local_vocab > vocab_size:
        padding = torch.arange(start, start + local_vocab, device=z.device) >= vocab_size
        z = z.masked_fill(padding, float("-inf"))

    with torch.no_grad():
        z_max = z.max(dim=-1).values
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            dist.all_reduce(z_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = z - z_max.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_sum_exp = sum_exp.log()

    owned = (labels >= start) & (labels < start + local_vocab)
    local_label = (labels - start).clamp(0, local_vocab - 1)
    label_logit = torch.where(owned, shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1), 0.0)
    log_probs = reduce_from_tensor_model_parallel_region(label_logit) - log_sum_exp

    if not with_entropy:
        return log_probs, None
    finite_shifted = shifted if padding is None else shifted.masked_fill(padding, 0.0)
    expected_shifted = reduce_from_tensor_model_parallel_region((exp * finite_shifted).sum(dim=-1)) / sum_exp
    return log_probs, log_sum_exp - expected_shifted
