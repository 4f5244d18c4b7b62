"""Per-token log-probabilities and entropy from vocabulary-parallel logits, computed in token chunks.

Each tensor-parallel rank holds logits for its slice of the vocabulary, `[batch, seq, vocab / TP]`. The softmax
normaliser is assembled from per-rank pieces, so no rank ever holds a `[tokens, vocab]` tensor:

    z = logits / T,   m = max_v z (all-reduce MAX),   S = Σ_v exp(z_v − m) (all-reduce SUM),   lse = m + log S
    log p_v = z_v − lse,      log p(y) = log p_y  (taken on the rank that owns y, then all-reduce SUM)
    H = −Σ_v p_v log p_v      (all-reduce SUM)

The tokens are processed `chunk_tokens` at a time: each chunk is cast to float32, reduced, and dropped, so the
memory above the (bf16) logits is two float32 buffers of one chunk, `[chunk_tokens, vocab / TP]`, in the forward
and in the backward. Only `lse` and `H` per token are kept; the backward recomputes log p chunk by chunk and needs
no communication (lse and H are already global):

    ∂L/∂z_v = g_lp · (1[v = y] − p_v) − g_H · p_v (log p_v + H),     ∂L/∂logits = ∂L/∂z / T

Columns at or beyond the true vocabulary size (padding for TP divisibility) get probability zero and gradient zero.
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


def _scaled_chunk(logits: torch.Tensor, temperature: float, padding: torch.Tensor | None) -> torch.Tensor:
    """z = logits / T in a fresh float32 buffer `[chunk, vocab / TP]`, padding columns at a finite −∞ stand-in
    (exp gives exactly 0, and 0 · it stays 0 in the entropy sum)."""
    z = logits.float().div_(temperature) if logits.dtype != torch.float32 else logits.div(temperature)
    if padding is not None:
        z.masked_fill_(padding, _NEG)
    return z


class _ChunkedVocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size, temperature, chunk_tokens):
        local_vocab = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * local_vocab
        columns = torch.arange(start, start + local_vocab, device=logits.device)
        padding = columns >= vocab_size if vocab_size is not None and start + local_vocab > vocab_size else None
        flat, flat_labels = logits.reshape(-1, local_vocab), labels.reshape(-1)
        tokens = flat.shape[0]
        step = min(chunk_tokens or tokens, tokens) or 1
        owned = (flat_labels >= start) & (flat_labels < start + local_vocab)
        local_label = (flat_labels - start).clamp(0, local_vocab - 1)
        lse = torch.empty(tokens, dtype=torch.float32, device=logits.device)
        picked_and_entropy = torch.empty(2, tokens, dtype=torch.float32, device=logits.device)
        for begin in range(0, tokens, step):
            end = min(begin + step, tokens)
            log_p = _scaled_chunk(flat[begin:end], temperature, padding)
            max_z = _all_reduce(log_p.max(dim=-1).values, dist.ReduceOp.MAX)
            log_p -= max_z.unsqueeze(-1)
            p = log_p.exp()
            sum_exp = _all_reduce(p.sum(dim=-1))
            log_p -= sum_exp.log().unsqueeze(-1)
            p /= sum_exp.unsqueeze(-1)
            lse[begin:end] = max_z + sum_exp.log()
            picked = log_p.gather(-1, local_label[begin:end].unsqueeze(-1)).squeeze(-1)
            picked_and_entropy[0, begin:end] = torch.where(owned[begin:end], picked, 0.0)
            picked_and_entropy[1, begin:end] = -torch.einsum("tv,tv->t", p, log_p)
            del log_p, p
        log_probs, entropy = _all_reduce(picked_and_entropy)  # the owner's log p(y), and Σ over vocab slices
        ctx.save_for_backward(logits, local_label, owned, lse, entropy)
        ctx.temperature, ctx.step, ctx.padding = temperature, step, padding
        return log_probs.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, local_label, owned, lse, entropy = ctx.saved_tensors
        local_vocab = logits.shape[-1]
        flat = logits.reshape(-1, local_vocab)
        g_lp = grad_log_probs.reshape(-1).float() if grad_log_probs is not None else torch.zeros_like(lse)
        g_h = grad_entropy.reshape(-1).float() if grad_entropy is not None else None
        grad = torch.empty_like(flat)
        for begin in range(0, flat.shape[0], ctx.step):
            end = min(begin + ctx.step, flat.shape[0])
            log_p = _scaled_chunk(flat[begin:end], ctx.temperature, ctx.padding)
            log_p -= lse[begin:end].unsqueeze(-1)
            # ∂L/∂z = −p · (g_lp + g_H (log p + H)), then + g_lp at the label
            if g_h is not None:
                chunk_grad = (log_p + entropy[begin:end].unsqueeze(-1)).mul_(g_h[begin:end].unsqueeze(-1))
                chunk_grad += g_lp[begin:end].unsqueeze(-1)
            else:
                chunk_grad = g_lp[begin:end].unsqueeze(-1).expand_as(log_p).clone()
            chunk_grad *= log_p.exp_()  # log p is not needed again: its buffer becomes p
            chunk_grad.neg_()
            label_grad = (g_lp[begin:end] * owned[begin:end]).unsqueeze(-1)
            chunk_grad.scatter_add_(-1, local_label[begin:end].unsqueeze(-1), label_grad)
            if ctx.padding is not None:
                chunk_grad.masked_fill_(ctx.padding, 0.0)
            grad[begin:end] = chunk_grad.div_(ctx.temperature)
            del log_p, chunk_grad
        return grad.view(logits.shape), None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    vocab_size: int | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log π(label) `[batch, seq]` and, if asked, the entropy `[batch, seq]` (float32), from this rank's logits
    slice `[batch, seq, vocab / TP]`; `vocab_size` is the true vocabulary (padding columns excluded).
    `chunk_tokens` (`model.logprob_chunk_tokens`, on `RoleModel`): tokens per float32 chunk; None: all at once."""
    log_probs, entropy = _ChunkedVocabParallelLogProbEntropy.apply(
        logits, labels, vocab_size, temperature, chunk_tokens
    )
    return log_probs, entropy if with_entropy else None
