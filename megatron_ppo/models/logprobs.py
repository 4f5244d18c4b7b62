"""Per-token log-probabilities and entropy from vocabulary-parallel logits, computed in token chunks.

Each tensor-parallel rank holds logits for its slice of the vocabulary, `[batch, seq, vocab / TP]`. The softmax
normaliser is assembled from per-rank pieces, so no rank ever holds a `[tokens, vocab]` tensor:

    z = logits / T,   m = max_v z (all-reduce MAX),   S = Σ_v exp(z_v − m) (all-reduce SUM),   lse = m + log S
    log p_v = z_v − lse,      log p(y) = log p_y  (taken on the rank that owns y, then all-reduce SUM)
    H = −Σ_v p_v log p_v      (all-reduce SUM)

The tokens are processed `chunk_tokens` at a time. The forward takes y = z − m and e^y of a chunk a row block
(`_EXP_ROWS`) at a time and log p(y) from the logits at the label, so the memory above the logits is two float32
blocks `[_EXP_ROWS, vocab / TP]`; the backward casts one chunk of bf16 logits to float32 at a time (float32 logits
are reduced in place, below). With S = Σ_v e^{y_v} (all-reduced):

    log p(y) = y_label − log S,      H = log S − Σ_v e^{y_v}·y_v / S

(the entropy only when asked for: `with_entropy`). Only `lse` and `H` per token are kept; the backward recomputes
log p chunk by chunk and needs no communication (lse and H are already global):

    ∂L/∂z_v = g_lp · (1[v = y] − p_v) − g_H · p_v (log p_v + H),     ∂L/∂logits = ∂L/∂z / T

and, like Megatron's fused cross-entropy, writes the gradient into the logits' own storage (they are not needed
again), so no second `[tokens, vocab / TP]` tensor exists — unless the logits are a leaf or a view into part of
another tensor (then a fresh one); float32 logits are even reduced in place, chunk by chunk, without a float32
copy.

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


def _chunk_max(logits: torch.Tensor, temperature: float, real_columns: int) -> torch.Tensor:
    """m = max_v z over every rank's slice (all-reduce MAX), float32 `[chunk]`, from this slice's `real_columns`
    (padding columns lie at its end): max(logits) / T, the same number as max(logits / T) for T > 0."""
    if real_columns > 0:
        local = logits[:, :real_columns].max(dim=-1).values.float().div_(temperature)
    else:
        local = torch.full(logits.shape[:1], _NEG, dtype=torch.float32, device=logits.device)
    return _all_reduce(local, dist.ReduceOp.MAX)


def _shifted_block(
    logits: torch.Tensor, temperature: float, max_z: torch.Tensor, padding: torch.Tensor | None
) -> torch.Tensor:
    """y = z − m in a fresh float32 buffer `[rows, vocab / TP]` (one pass from float32 logits at T = 1), padding
    columns at the −∞ stand-in."""
    if logits.dtype == torch.float32 and temperature == 1.0:
        shifted = logits - max_z.unsqueeze(-1)
        if padding is not None:
            shifted.masked_fill_(padding, _NEG)
        return shifted
    return _scaled_chunk(logits, temperature, padding).sub_(max_z.unsqueeze(-1))


def _owns_storage(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory is its own to overwrite: not a leaf the caller holds, contiguous, and either no
    view or a view of its whole base (the model's `[s, b] → [b, s]` transpose of batch-major logits)."""
    if tensor.is_leaf or not tensor.is_contiguous():
        return False
    base = tensor._base
    return base is None or (base.numel() == tensor.numel() and base.data_ptr() == tensor.data_ptr())


_EXP_ROWS = 128  # rows of a chunk whose y and exp(y) (forward) or factor (backward) exist at once: [128, vocab / TP]


class _ChunkedVocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_size, temperature, chunk_tokens, with_entropy):
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
        picked_and_entropy = torch.zeros(2, tokens, dtype=torch.float32, device=logits.device)
        real_columns = local_vocab if padding is None else max(0, vocab_size - start)
        for begin in range(0, tokens, step):
            end = min(begin + step, tokens)
            chunk = flat[begin:end]
            max_z = _chunk_max(chunk, temperature, real_columns)
            sum_exp = torch.empty_like(max_z)
            exp_dot_shifted = torch.empty_like(max_z) if with_entropy else None
            for row in range(0, end - begin, _EXP_ROWS):  # y = z − m and e^y a block of rows at a time
                rows = slice(row, row + _EXP_ROWS)
                shifted = _shifted_block(chunk[rows], temperature, max_z[rows], padding)
                exp_block = shifted.exp()
                sum_exp[rows] = exp_block.sum(dim=-1)
                if exp_dot_shifted is not None:
                    exp_dot_shifted[rows] = torch.einsum("tv,tv->t", exp_block, shifted)
                del shifted, exp_block
            local_sum_exp = sum_exp.clone() if with_entropy else None
            log_sum_exp = _all_reduce(sum_exp).log()
            lse[begin:end] = max_z + log_sum_exp
            label_z = chunk.gather(-1, local_label[begin:end].unsqueeze(-1)).squeeze(-1).float().div_(temperature)
            picked = label_z - max_z - log_sum_exp
            picked_and_entropy[0, begin:end] = torch.where(owned[begin:end], picked, 0.0)
            if with_entropy:  # this slice's −Σ p log p = Σ e^y (log S − y) / S
                picked_and_entropy[1, begin:end] = (log_sum_exp * local_sum_exp - exp_dot_shifted) / sum_exp
        log_probs, entropy = _all_reduce(picked_and_entropy)  # the owner's log p(y), and Σ over vocab slices
        ctx.save_for_backward(logits, local_label, owned, lse, entropy)
        ctx.temperature, ctx.step, ctx.padding = temperature, step, padding
        return log_probs.view(labels.shape), entropy.view(labels.shape)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, local_label, owned, lse, entropy = ctx.saved_tensors
        local_vocab = logits.shape[-1]
        # the gradient goes where the logits were (Megatron's cross-entropy does the same with its softmax): only a
        # tensor of their own — not a leaf the caller holds, not a view into another tensor
        in_place = _owns_storage(logits)
        flat = logits.reshape(-1, local_vocab)
        grad = flat if in_place else torch.empty_like(flat)
        # 1/T folded into the incoming gradients: ∂L/∂logits = −p (g_lp/T + g_H/T (log p + H)) + g_lp/T at the label
        g_lp = grad_log_probs.reshape(-1).float() / ctx.temperature if grad_log_probs is not None else None
        g_h = grad_entropy.reshape(-1).float() / ctx.temperature if grad_entropy is not None else None
        if g_lp is None:
            g_lp = torch.zeros_like(lse)
        for begin in range(0, flat.shape[0], ctx.step):
            end = min(begin + ctx.step, flat.shape[0])
            chunk = flat[begin:end]
            if in_place and chunk.dtype == torch.float32 and ctx.temperature == 1.0:
                log_p = chunk  # reduced in the storage that becomes the gradient: no float32 copy
                if ctx.padding is not None:
                    log_p.masked_fill_(ctx.padding, _NEG)
            else:
                log_p = _scaled_chunk(chunk, ctx.temperature, ctx.padding)
            log_p -= lse[begin:end].unsqueeze(-1)
            minus_g_lp = -g_lp[begin:end].unsqueeze(-1)
            if g_h is None:
                log_p.exp_().mul_(minus_g_lp)  # log p is not needed again: its buffer becomes p, then the gradient
            else:
                # p (−g_lp − g_H (log p + H)) = p (a − g_H log p), a = −g_lp − g_H·H per token: one pass for the
                # factor (it needs log p, the buffer becomes p), a block at a time
                minus_g_h = -g_h[begin:end].unsqueeze(-1)
                offset = torch.addcmul(minus_g_lp, minus_g_h, entropy[begin:end].unsqueeze(-1))
                for row in range(0, end - begin, _EXP_ROWS):
                    block, rows = log_p[row : row + _EXP_ROWS], slice(row, row + _EXP_ROWS)
                    factor = torch.addcmul(offset[rows], block, minus_g_h[rows])
                    block.exp_().mul_(factor)
                    del factor
            label_grad = (g_lp[begin:end] * owned[begin:end]).unsqueeze(-1)
            log_p.scatter_add_(-1, local_label[begin:end].unsqueeze(-1), label_grad)
            if ctx.padding is not None:
                log_p.masked_fill_(ctx.padding, 0.0)
            if log_p is not chunk:
                grad[begin:end] = log_p
            del log_p
        return grad.view(logits.shape), None, None, None, None, None


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
        logits, labels, vocab_size, temperature, chunk_tokens, with_entropy
    )
    return log_probs, entropy if with_entropy else None
