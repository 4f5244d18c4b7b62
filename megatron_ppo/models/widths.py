"""The one rule for the shape (rows × tokens per row) a micro-batch enters the model with, and what padding to it
costs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

CUDA_WIDTH_BUCKET = 128


def width_bucket(configured: int | None, cuda: bool) -> int:
    """The multiple micro-batch widths are rounded up to: `configured`
    (`megatron.make_sequence_length_divisible_by`) when set; else `CUDA_WIDTH_BUCKET` on CUDA, where a new width
    costs a cuDNN attention graph and a `torch.compile` recompile of the fusions, and flash-attention tiles and
    GEMMs run whole at multiples of 64/128 (≤ 127 padded tokens per row: ≤ 3 % at 4096 tokens), and 1 on CPU,
    where no kernel is built per shape and every padded token costs its full share of compute."""
    if configured is not None:
        return configured
    return CUDA_WIDTH_BUCKET if cuda else 1


def padded_width(width: int, cp_size: int = 1, tp_for_sequence_parallel: int = 1, bucket: int = 1) -> int:
    """The smallest S ≥ `width` that the layout can cut evenly and that is a multiple of `bucket`: S is a multiple
    of lcm(L, `bucket`), L = 2·CP·TP with context parallelism (each CP rank holds two chunks of S / (2·CP) tokens,
    `models.context_parallel`, which sequence parallelism cuts over TP once more), TP with sequence parallelism
    alone (Megatron's scatter of `[s, b, h]` over the TP ranks needs s % TP == 0), 1 otherwise.
    `tp_for_sequence_parallel`: TP, or 1 without sequence parallelism. `bucket` (`width_bucket`): on CUDA the
    attention kernels (cuDNN SDPA builds a graph per new shape) and the `torch.compile`d fusions see a handful of
    widths instead of one per micro-batch. Rows are
    right-padded to S and the model's outputs cut back to `width` (`models.schedule`)."""
    layout = (2 * cp_size if cp_size > 1 else 1) * tp_for_sequence_parallel
    multiple = math.lcm(layout, bucket)
    return -(-width // multiple) * multiple


def pass_shape(shapes: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """One `(rows, width)` for every micro-batch of a pipeline pass — the largest rows and the largest width of
    `shapes` (each already padded by `padded_width`) — so Megatron's pipeline messages have one fixed shape and
    need no shape exchange (`variable_seq_lengths` off: no host sync and `.tolist()` before each send/receive).
    None when that shape holds more tokens than the pass's largest micro-batch (token-budget micro-batches: many
    short rows in one, few long ones in another): padding to it would raise the activation memory the budget
    bounds, so such a pass keeps its own shapes and Megatron exchanges them."""
    rows, width = (max(sizes) for sizes in zip(*shapes, strict=True))
    return (rows, width) if rows * width <= max(r * w for r, w in shapes) else None


@dataclass
class PaddingTally:
    """Tokens a role's model computed (`padded`: rows × width of every micro-batch as it entered the model, a host
    int) against the real ones (`real`: Σ row lengths, accumulated where the lengths live — a device scalar on
    CUDA, read once per iteration); `perf/padded_over_real_tokens` = padded / real (1: no padding)."""

    padded: int = 0
    real: torch.Tensor | int = field(default=0)

    def add(self, padded: int, real: torch.Tensor | int) -> None:
        self.padded += padded
        self.real = self.real + real
