"""The context-parallel split of a micro-batch and its inverse, and the per-sequence split of a pack (pure tensor
arithmetic)."""

from __future__ import annotations

import random

import pytest
import torch

from megatron_ppo.models.context_parallel import (
    chunk_positions,
    merge_chunks,
    segment_chunk_positions,
    split_micro_batch,
)
from megatron_ppo.models.packing import build_pack
from megatron_ppo.models.widths import padded_width


def _batch(width: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(width)
    return {
        "input_ids": torch.randint(1, 50, (3, width), generator=generator),
        "position_ids": torch.arange(width).expand(3, width).clone(),
        "loss_mask": (torch.rand(3, width, generator=generator) > 0.3).float(),
        "logits": torch.randn(3, width, 7, generator=generator),
        "lengths": torch.tensor([width, width - 1, 2]),
    }


@pytest.mark.parametrize(("cp", "width"), [(2, 8), (2, 11), (4, 13), (4, 16)])
def test_split_then_merge_gives_back_every_token_and_keeps_positions(cp: int, width: int) -> None:
    batch = _batch(width)
    parts = [split_micro_batch(batch, cp, rank) for rank in range(cp)]
    full = padded_width(width, cp)
    assert full % (2 * cp) == 0 and full - width < 2 * cp
    for rank, part in enumerate(parts):
        assert part["input_ids"].shape == (3, full // cp)
        positions = chunk_positions(full, cp, rank)
        expected = torch.where(positions < width, positions, 0)  # padding at position 0: in every learned table
        assert torch.equal(part["position_ids"][0], expected), "positions must travel along"
        assert torch.equal(part["lengths"], batch["lengths"]), "per-row tensors stay whole"
    for key in ("input_ids", "position_ids", "loss_mask", "logits"):
        assert torch.equal(merge_chunks([part[key] for part in parts], width), batch[key]), key
    padding = torch.cat([part["loss_mask"] for part in parts], dim=1).sum() - batch["loss_mask"].sum()
    assert padding == 0, "padded tokens must be outside the loss mask"


def test_a_micro_batch_pads_to_its_pipeline_pass_width_and_merges_back() -> None:
    batch, cp = _batch(11), 2
    parts = [split_micro_batch(batch, cp, rank, full_width=32) for rank in range(cp)]  # the pass's widest: 32
    assert all(part["input_ids"].shape == (3, 16) for part in parts)
    for key in ("input_ids", "position_ids", "loss_mask", "logits"):
        assert torch.equal(merge_chunks([part[key] for part in parts], 11), batch[key]), key
    with pytest.raises(ValueError, match="equal chunks"):
        split_micro_batch(batch, cp, 0, full_width=30)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_each_rank_gets_the_same_causal_attention_work(cp: int) -> None:
    """Rank r holds chunks r and 2·CP − 1 − r: the keys its queries see, Σ (position + 1), are equal on all ranks."""
    width = 64
    work = [int((chunk_positions(width, cp, rank) + 1).sum()) for rank in range(cp)]
    assert len(set(work)) == 1, work
    covered = torch.cat([chunk_positions(width, cp, rank) for rank in range(cp)]).sort().values
    assert torch.equal(covered, torch.arange(width))


def test_sequence_parallel_pads_for_the_tensor_parallel_split_too() -> None:
    assert padded_width(13, cp_size=2, tp_for_sequence_parallel=4) == 16
    assert padded_width(17, cp_size=2, tp_for_sequence_parallel=4) == 32


def test_sequence_parallel_alone_pads_to_a_multiple_of_tp_and_nothing_else_pads() -> None:
    assert [padded_width(w, 1, 2) for w in (11, 12, 13)] == [12, 12, 14]
    assert padded_width(13, 1, 4) == 16
    assert padded_width(13) == 13, "without context or sequence parallelism the width is the micro-batch's own"


def test_an_explicit_attention_mask_is_refused() -> None:
    batch = _batch(8) | {"attention_mask": torch.ones(3, 1, 8, 8, dtype=torch.bool)}
    with pytest.raises(ValueError, match="causal attention"):
        split_micro_batch(batch, 2, 0)


def _partitioned_indices(segments: list[int], cp: int, rank: int) -> list[int]:
    """Transformer Engine's `thd_partition_indices_kernel` (fused_attn/thd_utils.cu), one token at a time: local
    token t of sequence i (local offsets Σ p_j / CP) comes from chunk r in the first half of the sequence's local
    tokens, from chunk 2·CP − 1 − r in the second."""
    local = [0]
    for length in segments:
        local.append(local[-1] + length // cp)
    out = []
    for token in range(local[-1]):
        seq = max(i for i in range(len(segments)) if local[i] <= token)
        seq_len, index = local[seq + 1] - local[seq], token - local[seq]
        offset = rank if index < seq_len // 2 else (cp - 1) * 2 - rank
        out.append(index + local[seq] * cp + offset * (seq_len // 2))
    return out


def test_a_packs_split_is_per_sequence_as_transformer_engines() -> None:
    """Segments 8, 4, 12 at CP 2 (chunks of 2, 1, 3): rank 0 holds the first and last chunk of each, rank 1 the
    middle two; and for random packs at CP 2 and 4, TE's THD partition token by token."""
    assert segment_chunk_positions([8, 4, 12], 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 13, 14, 21, 22, 23]
    assert segment_chunk_positions([8, 4, 12], 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 15, 16, 17, 18, 19, 20]
    rng = random.Random(0)
    for cp in (2, 4):
        segments = [2 * cp * rng.randint(1, 5) for _ in range(6)]
        held = [segment_chunk_positions(segments, cp, rank) for rank in range(cp)]
        for rank in range(cp):
            assert held[rank].tolist() == _partitioned_indices(segments, cp, rank), (cp, rank)
        assert torch.equal(torch.cat(held).sort().values, torch.arange(sum(segments))), "every token once"
    with pytest.raises(ValueError, match="equal chunks"):
        segment_chunk_positions([8, 6], 2, 0)


@pytest.mark.parametrize(("cp", "tail"), [(2, 0), (2, 8), (4, 8)])
def test_a_packs_split_gives_each_sequence_the_padded_split_of_its_row(cp: int, tail: int) -> None:
    """Each sequence of a pack padded to 2·CP (`build_pack`, the pass's tail in the last segment): the tokens a
    rank holds of segment i are the ones the padded split gives it of row i alone, padded to p_i."""
    batch = _batch(13)
    lengths = [13, 12, 2]
    pack = build_pack(lengths, 13, 2 * cp)
    pack = build_pack(lengths, 13, 2 * cp, width=pack.width + tail)
    packed = pack.pack(batch["input_ids"])[0]
    for rank in range(cp):
        local = packed[segment_chunk_positions(pack.segments, cp, rank)]
        pieces = local.split([p // cp for p in pack.segments])
        for row, (length, segment, piece) in enumerate(zip(lengths, pack.segments, pieces, strict=True)):
            alone = {"input_ids": batch["input_ids"][row : row + 1, :length]}
            expected = split_micro_batch(alone, cp, rank, full_width=segment)["input_ids"][0]
            assert torch.equal(piece, expected), (rank, row)
