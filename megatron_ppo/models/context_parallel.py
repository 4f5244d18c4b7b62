"""Context parallelism: each rank of a CP group holds part of every sequence, load-balanced for causal attention.

A micro-batch of width W is right-padded to S, a multiple of 2·CP (of 2·CP·TP with sequence parallelism, whose
layers split the local sequence once more), and cut into 2·CP chunks of S / (2·CP) tokens; CP rank r holds chunks
r and 2·CP − 1 − r (Megatron's `get_batch_on_this_cp_rank`), so every rank gets an early and a late chunk and the
same causal-attention work. Every per-token tensor of the micro-batch `[b, W]` (input ids, positions, labels, masks,
old log-probs, advantages, …) is cut the same way, so the loss sees this rank's tokens with their own positions
(RoPE: Megatron's `get_pos_emb_on_this_cp_rank` takes the same chunks of the full-length table). Transformer
Engine's attention exchanges keys and values around the ring; nothing else in the model mixes tokens.

Loss: each rank's loss is its tokens' share Σ_local / N_global × DP (global counts, `megatron_ppo.algo.agg_loss`).
Megatron's schedule multiplies it by CP (`forward_step_calc_loss`), and its DDP divides gradients by DP·CP while
summing them over the DP×CP ranks, so the gradient is Σ_{DP,CP} CP·∇(Σ_local / N·DP) / (DP·CP) = ∇(Σ / N): the
scale is kept, not undone. (A loss that needs a whole sequence — `seq-mean-token-mean` divides by each row's
token count — is refused with CP by validation.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_ppo.models.widths import padded_width

MicroBatch = dict[str, torch.Tensor]


def chunk_positions(width: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions of a `width`-token sequence (divisible by 2·CP) held by CP rank `cp_rank`, in order: chunk
    `cp_rank` then chunk 2·CP − 1 − `cp_rank`, each of width / (2·CP) tokens. Shape `[width / CP]`."""
    return segment_chunk_positions([width], cp_size, cp_rank)


def segment_chunk_positions(segments: Sequence[int], cp_size: int, cp_rank: int) -> torch.Tensor:
    """The positions held by CP rank r of a row of consecutive segments (a pack's sequences, each padded to a
    multiple of 2·CP: `models.packing.Pack.segments`), each split on its own: segment i of p_i tokens at offset
    o_i = Σ_{j<i} p_j is cut into 2·CP chunks of c_i = p_i / (2·CP), and rank r holds

        o_i + r·c_i + [0, c_i)   then   o_i + (2·CP − 1 − r)·c_i + [0, c_i),   for i = 0, 1, …

    in order: `[Σ p_i / CP]`. Every rank gets an early and a late chunk of every sequence, so the same causal
    attention work per sequence; it is Transformer Engine's `thd_get_partitioned_indices` for THD (Megatron's
    per-document balancing), and for one segment the padded rows' split (`chunk_positions`)."""
    parts = []
    offset = 0
    for length in segments:
        if length % (2 * cp_size):
            raise ValueError(f"a sequence of {length} tokens cannot be cut into 2·CP = {2 * cp_size} equal chunks")
        chunk = length // (2 * cp_size)
        for index in (cp_rank, 2 * cp_size - 1 - cp_rank):
            parts.append(torch.arange(offset + index * chunk, offset + (index + 1) * chunk))
        offset += length
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def split_micro_batch(
    batch: MicroBatch, cp_size: int, cp_rank: int, tp_for_sequence_parallel: int = 1, full_width: int | None = None
) -> MicroBatch:
    """This CP rank's tokens of every per-token tensor (`[b, W, ...]`, W = `input_ids`' width) of `batch`, after
    right-padding W to `full_width` (the pass's width, `models.schedule.model_shapes`; by default `padded_width`),
    zeros: padded tokens are outside every mask, and position 0 is in every learned position table (as
    `models.moe.pad_tokens`). Per-row tensors (`[b]`, e.g.
    `lengths`, `scores`) are kept whole."""
    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism runs causal attention without an explicit attention mask")
    width = batch["input_ids"].shape[1]
    full = full_width or padded_width(width, cp_size, tp_for_sequence_parallel)
    if full < width or full % (2 * cp_size * tp_for_sequence_parallel):
        raise ValueError(
            f"cannot pad a {width}-token micro-batch to {full} tokens and cut it into 2·CP·TP = "
            f"{2 * cp_size * tp_for_sequence_parallel} equal chunks: take the width from models.widths.padded_width"
        )
    index = chunk_positions(full, cp_size, cp_rank).to(batch["input_ids"].device)
    out = {}
    for key, value in batch.items():
        if value is None or value.dim() < 2 or value.shape[1] != width:
            out[key] = value
            continue
        padded = torch.nn.functional.pad(value, (0, 0) * (value.dim() - 2) + (0, full - width))
        out[key] = padded.index_select(1, index)
    return out


def merge_chunks(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    """The inverse of the split: the `[b, S / CP, ...]` parts of CP ranks 0…CP−1 → the `[b, width, ...]` rows
    (padding dropped)."""
    cp_size = len(parts)
    full = parts[0].shape[1] * cp_size
    out = parts[0].new_zeros((parts[0].shape[0], full, *parts[0].shape[2:]))
    for rank, part in enumerate(parts):
        out[:, chunk_positions(full, cp_size, rank).to(part.device)] = part
    return out[:, :width]


def gather_per_token(local: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Every CP rank's `[b, S / CP, ...]` tokens of a forward-only result, all-gathered over `group` and put back
    in sequence order: `[b, width, ...]` on every rank of the group (no gradient flows through)."""
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return merge_chunks(parts, width)
