"""Per-token log-probabilities and entropy from vocabulary-parallel logits.

Each tensor-parallel rank holds logits for its slice of the vocabulary, `[batch, seq, vocab / TP]`. The softmax
normaliser is assembled from per-rank pieces, so no rank ever holds a `[tokens, vocab]` tensor:

    z = logits / T,   m = max_v z (all-reduce MAX),   S = Σ_v exp(z_v − m) (all-reduce SUM)
    log p_v = z_v − m − log S,      log p(y) = log p_y  (taken on the rank that owns y, then all-reduce SUM)
    H = −Σ_v p_v log p_v            (all-reduce SUM)

One autograd function computes both and keeps a single `[tokens, vocab / TP]` tensor (log p) for the backward,
which is closed-form and needs no communication (S and H are already global):

    ∂L/∂z_v = g_lp · (1[v = y] − p_v) − g_H · p_v (log p_v + H),     ∂L/∂logits = ∂L/∂z / T

Columns at or beyond the true vocabulary size (padding for TP divisibility) get probability zero.
The backward reuses the saved log p buffer in place, so the graph cannot be run backward twice.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

_NEG = -1.0e30


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(tensor, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return tensor


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """Peak memory: two `[tokens, vocab / TP]` float32 buffers in forward (log p, p) and in backward (log p, which
    becomes p in place, and the gradient)."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, temperature):
        local_vocab = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local_vocab
        log_p = logits.float().div(temperature)  # a fresh buffer, turned into log p in place
        if vocab_size is not None and start + local_vocab > vocab_size:
            # a finite stand-in for −inf: exp gives exactly 0, and 0 · it stays 0 in the entropy sum
            log_p.masked_fill_(torch.arange(start, start + local_vocab, device=log_p.device) >= vocab_size, _NEG)
        log_p -= _all_reduce(log_p.max(dim=-1).values, dist.ReduceOp.MAX).unsqueeze(-1)
        p = log_p.exp()
        sum_exp = _all_reduce(p.sum(dim=-1))
        log_p -= sum_exp.log().unsqueeze(-1)
        p /= sum_exp.unsqueeze(-1)
        entropy = -_all_reduce(torch.einsum("...v,...v->...", p, log_p))
        del p

        owned = (labels >= start) & (labels < start + local_vocab)
        local_label = (labels - start).clamp(0, local_vocab - 1)
        log_probs = _all_reduce(torch.where(owned, log_p.gather(-1, local_label.unsqueeze(-1)).squeeze(-1), 0.0))
        ctx.save_for_backward(log_p, local_label, owned, entropy)
        ctx.temperature, ctx.logits_dtype = temperature, logits.dtype
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        log_p, local_label, owned, entropy = ctx.saved_tensors
        if grad_log_probs is None:
            grad_log_probs = torch.zeros_like(entropy)
        # grad = −p · (g_lp + g_H (log p + H)), then + g_lp at the label
        grad = log_p + entropy.unsqueeze(-1)
        grad *= grad_entropy.unsqueeze(-1) if grad_entropy is not None else 0.0
        grad += grad_log_probs.unsqueeze(-1)
        grad *= log_p.exp_()  # log p is not needed again: reuse its buffer for p
        grad.neg_()
        grad.scatter_add_(-1, local_label.unsqueeze(-1), (grad_log_probs * owned).unsqueeze(-1))
        return (grad / ctx.temperature).to(ctx.logits_dtype), None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(label) `[batch, seq]` and, if asked, the entropy `[batch, seq]` (float32), from this rank's logits
    slice `[batch, seq, vocab / TP]`; `vocab_size` is the true vocabulary (padding columns excluded)."""
    log_probs, entropy = _VocabParallelLogProbEntropy.apply(logits, labels, vocab_size, temperature)
    return log_probs, entropy if with_entropy else None
