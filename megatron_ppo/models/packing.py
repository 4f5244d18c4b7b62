"""Packed sequences (THD): a micro-batch of rows enters the model as one `[1, T]` row of whole sequences.

A micro-batch of b rows with lengths l_0 … l_{b−1} (right-padded to s tokens, `train/batch.py`) is packed as

    segment i = row i's l_i tokens, then padding up to p_i = ⌈l_i / m⌉·m,        T = Σ_i p_i (+ a tail)

m = the layout's multiple (`pack_multiple`: TP with sequence parallelism, whose scatter of `[T, 1, h]` over the
TP ranks needs T % TP = 0; 1 otherwise — verl's `preprocess_packed_seqs` and NeMo-RL's
`_pack_sequences_for_megatron` pad each sequence the same way, to 2·CP·TP with context parallelism, which packing
does not serve yet). The tail (T rounded up to the pass's shape: the CUDA width bucket, one shape per pipeline
pass, the expert-parallel group's largest) is absorbed into the last segment, so the segments tile `[0, T)`.
Megatron's `PackedSeqParams(qkv_format="thd")` carries cu_seqlens_q = cu_seqlens_kv = [0, l_0, l_0 + l_1, …] (real
tokens) and cu_seqlens_*_padded = [0, p_0, p_0 + p_1, …, T] — the same tensor as cu_seqlens_* when the pack holds
no padding at all, and `pad_between_seqs` set from the host otherwise (`build_pack`); max_seqlen_* = max_i p_i, and
a host copy of the padded bounds (`HostPackedSeqParams.segment_bounds`) for our SDPA. Attention is causal inside
each segment (`models.attention.SDPAttention`, Transformer Engine's THD kernels on GPU). A segment's padding comes
after its real tokens, so under causal attention no real token sees it.

The positions of a pack are one fact, `Pack.position_ids` `[1, T]`: token t of sequence i at t − start_i, every
padding token (a sequence's padding to m, the tail) at 0. The learned absolute embedding reads them on the first
pipeline stage, and RoPE on every stage and chunk (`parallel.megatron_compat.rotary_per_token`: the angles
freqs[position_ids] gathered once per forward, the pack rotated whole). Padding at 0 keeps every id inside the
position table: the tail of a pass's shape (PP: every pack as wide as the pass's largest) would otherwise count on
past `max_position_embeddings` in the last segment.

The model's last-stage output `[1, T, …]` (logits, values) is turned into per-token results inside the packed
layout (log-probs over the vocabulary: only real and per-sequence padding tokens), then `Pack.unpack` gathers them
back to the rows `[b, s, …]` the trainer uses (zeros beyond a row's length), with its gradient scattered back.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ppo.parallel.megatron_compat import packed_seq_fields

PACK = "pack"  # the micro-batch key the schedule hands `loss_fn` a packed micro-batch's `Pack` under


def pack_multiple(cp_size: int, tp_for_sequence_parallel: int) -> int:
    """m, the multiple each sequence of a pack is padded to: TP with sequence parallelism, else 1 (context
    parallelism would need 2·CP·TP and a per-sequence load-balanced split: refused by validation)."""
    if cp_size > 1:
        raise ValueError("packed sequences do not serve context parallelism yet (model.pack_sequences)")
    return tp_for_sequence_parallel


def segment_lengths(lengths: Sequence[int], multiple: int) -> list[int]:
    """p_i = ⌈l_i / m⌉·m for each sequence of a pack."""
    return [-(-length // multiple) * multiple for length in lengths]


@dataclass
class HostPackedSeqParams(PackedSeqParams):
    """Megatron's `PackedSeqParams` with a host copy of `cu_seqlens_q_padded`, `segment_bounds`, so that our SDPA
    attention cuts the pack without reading the device (a sync per layer on a GPU). Not one of Megatron's fields:
    Transformer Engine's wrapper forwards only those (`dataclasses.fields(PackedSeqParams)`)."""

    segment_bounds: tuple[int, ...] = ()


@dataclass
class Pack:
    """Where each row of a micro-batch lies in its `[1, width]` pack, and the model inputs that says.

    `index` `[b, s]` long: the pack position of row r's token t (0 where t ≥ l_r, masked by `real`); `real`
    `[b, s]` bool: t < l_r; `source` `[width]` long: the flat row position r·s + t each pack position holds (0 at
    padding, masked by `token_is_real`); `token_is_real` `[1, width]` bool; `position_ids` `[1, width]`: restart at
    each segment, 0 at padding; `params`: Megatron's THD description (tensors on the pack's device). Both directions
    are gathers by these precomputed indices (`index_select`, whose backward is an `index_add`): no boolean
    indexing, so no device read on a GPU."""

    lengths: list[int]
    segments: list[int]  # p_i, the last one with the tail: Σ = width
    width: int
    index: torch.Tensor
    real: torch.Tensor
    source: torch.Tensor
    token_is_real: torch.Tensor
    position_ids: torch.Tensor
    params: HostPackedSeqParams

    def pack(self, tensor: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """Per-row `[b, s, …]` → packed `[1, width, …]` (padding positions `fill`)."""
        out = tensor.flatten(0, 1).index_select(0, self.source)
        mask = self.token_is_real[0].reshape(-1, *([1] * (out.dim() - 1)))
        return torch.where(mask, out, torch.full((), fill, dtype=out.dtype, device=out.device)).unsqueeze(0)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """Packed `[1, width, …]` → per-row `[b, s, …]`: zeros beyond each row's length (differentiable: the
        gradient of each real token goes back to its pack position, padding positions get none)."""
        rows = packed[0].index_select(0, self.index.flatten()).view(*self.index.shape, *packed.shape[2:])
        mask = self.real.reshape(*self.real.shape, *([1] * (rows.dim() - 2)))
        return torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def build_pack(lengths: Sequence[int], row_width: int, multiple: int, width: int | None = None,
               device: torch.device | str = "cpu") -> Pack:  # fmt: skip
    """The pack of rows of `lengths` (each ≤ `row_width`, the micro-batch's width) with each sequence padded to
    `multiple`, in `width` tokens (default: Σ p_i; a larger width, a multiple of `multiple`, extends the last
    segment). Host arithmetic; the tensors are made on `device`."""
    lengths = [int(length) for length in lengths]
    segments = segment_lengths(lengths, multiple)
    total = sum(segments)
    width = total if width is None else width
    if width < total or (width - total) % multiple:
        raise ValueError(f"a pack of {total} tokens (sequences padded to {multiple}) cannot fill {width} tokens")
    segments[-1] += width - total
    starts = [0, *accumulate(segments)]
    offsets = torch.tensor(starts[:-1], dtype=torch.long)
    steps = torch.arange(row_width, dtype=torch.long)
    real = steps[None, :] < torch.tensor(lengths)[:, None]
    index = torch.where(real, offsets[:, None] + steps[None, :], 0)
    token_is_real = torch.zeros(width, dtype=torch.bool)
    token_is_real[index[real]] = True
    source = torch.zeros(width, dtype=torch.long)
    source[index[real]] = torch.arange(real.numel()).view_as(real)[real]
    segment_of = torch.repeat_interleave(torch.arange(len(segments)), torch.tensor(segments))
    position_ids = torch.where(token_is_real, torch.arange(width) - offsets[segment_of], 0)
    on = dict(device=device, non_blocking=True)
    cu_padded = torch.tensor(starts, dtype=torch.int32).to(**on)
    # No padding anywhere (every p_i = l_i, no tail): the padded cu_seqlens are the real ones, the same tensor, which
    # Transformer Engine reads as "no padding between sequences" (its FlashAttention stays eligible). Else they
    # differ and TE is told so (`pad_between_seqs`, where this Megatron has the field: no device read to infer
    # it); its fused (cuDNN) THD attention then leaves every segment's padding out.
    padded = starts[-1] != sum(lengths) or any(p != length for p, length in zip(segments, lengths, strict=True))
    cu_real = torch.tensor([0, *accumulate(lengths)], dtype=torch.int32).to(**on) if padded else cu_padded
    extra = {"pad_between_seqs": padded} if "pad_between_seqs" in packed_seq_fields() else {}
    params = HostPackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_real, cu_seqlens_kv=cu_real, cu_seqlens_q_padded=cu_padded,
        cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(segments), max_seqlen_kv=max(segments),
        segment_bounds=tuple(starts), **extra,
    )  # fmt: skip
    return Pack(
        lengths=lengths, segments=segments, width=width, index=index.to(**on), real=real.to(**on),
        source=source.to(**on), token_is_real=token_is_real[None].to(**on), position_ids=position_ids[None].to(**on),
        params=params,
    )  # fmt: skip


def packed_width(lengths: Sequence[int], multiple: int, bucket: int = 1) -> int:
    """The tokens a pack of `lengths` enters the model with before the pass's shape: Σ p_i rounded up to
    lcm(m, `bucket`) (the CUDA width bucket, `models.widths.width_bucket`); one step at least (an empty
    micro-batch of the interleaved schedule holds one row of no tokens)."""
    step = math.lcm(multiple, bucket)
    return max(1, -(-sum(segment_lengths(lengths, multiple)) // step)) * step


def per_row(batch: dict, output: torch.Tensor) -> torch.Tensor:
    """A per-token model output as the rows of `batch`: unpacked when the micro-batch ran packed, else as it is."""
    pack = batch.get(PACK)
    return output if pack is None else pack.unpack(output)


def labels_of(batch: dict) -> torch.Tensor:
    """The micro-batch's labels in the layout the model's output has: `[1, width]` packed, else `[b, s]`."""
    pack = batch.get(PACK)
    return batch["labels"] if pack is None else pack.pack(batch["labels"])
