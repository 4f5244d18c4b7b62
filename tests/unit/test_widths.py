"""The width rule (`models.widths`): buckets combined with the layout's multiple, one shape per pipeline pass
unless it exceeds the pass's largest micro-batch, the device default of the bucket, and the padding tally."""

from __future__ import annotations

import pytest
import torch

from megatron_ppo.models.widths import CUDA_WIDTH_BUCKET, PaddingTally, padded_width, pass_shape, width_bucket


@pytest.mark.parametrize(
    ("width", "cp", "tp", "bucket", "expected"),
    [
        (1, 1, 1, 64, 64),
        (64, 1, 1, 64, 64),
        (65, 1, 1, 64, 128),
        (13, 1, 1, 1, 13),
        (13, 1, 2, 64, 64),  # lcm(TP=2, 64)
        (13, 1, 3, 64, 192),  # lcm(TP=3, 64) = 192: the layout's cut stays even
        (100, 2, 1, 48, 144),  # lcm(2·CP=4, 48) = 48
        (100, 2, 3, 128, 384),  # lcm(2·CP·TP=12, 128) = 384
    ],
)
def test_bucketed_width_is_the_smallest_common_multiple_at_least_the_width(width, cp, tp, bucket, expected) -> None:
    got = padded_width(width, cp, tp, bucket)
    assert got == expected, f"padded_width({width}, cp={cp}, tp={tp}, bucket={bucket}) = {got}, not {expected}"
    layout = (2 * cp if cp > 1 else 1) * tp
    assert got >= width and got % bucket == 0 and got % layout == 0


def test_bucket_defaults_to_128_on_cuda_and_off_on_cpu_unless_configured() -> None:
    assert width_bucket(None, cuda=True) == CUDA_WIDTH_BUCKET == 128
    assert width_bucket(None, cuda=False) == 1
    assert width_bucket(64, cuda=True) == width_bucket(64, cuda=False) == 64


def test_one_pipeline_shape_for_fixed_micro_batches() -> None:
    assert pass_shape([(2, 10), (2, 12), (2, 8)]) == (2, 12)
    assert pass_shape([(4, 7)]) == (4, 7)


def test_token_budget_passes_keep_their_shapes_where_one_would_exceed_the_largest() -> None:
    # next-fit decreasing under an 18-token budget: 1 × 18, then 3 × 6 — one shape 3 × 18 would hold 54 tokens
    assert pass_shape([(1, 18), (3, 6)]) is None
    assert pass_shape([(2, 9), (2, 8), (1, 9)]) == (2, 9), "a shorter last micro-batch pads to the largest's rows"


def test_padding_tally_counts_computed_against_real_tokens() -> None:
    tally = PaddingTally()
    tally.add(2 * 64, torch.tensor([10, 12]).sum())
    tally.add(1 * 64, 20)
    assert tally.padded == 192 and int(tally.real) == 42
