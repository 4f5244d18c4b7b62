"""The context-parallel split of a micro-batch and its inverse (pure tensor arithmetic)."""

from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.context_parallel import chunk_positions, merge_chunks, split_micro_batch
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
