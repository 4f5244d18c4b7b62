"""The one rule for the width (tokens per row) a micro-batch enters the model with."""

from __future__ import annotations


def padded_width(width: int, cp_size: int = 1, tp_for_sequence_parallel: int = 1) -> int:
    """The smallest S ≥ `width` that the layout can cut evenly: a multiple of 2·CP·TP with context parallelism
    (each CP rank holds two chunks of S / (2·CP) tokens, `models.context_parallel`, which sequence parallelism cuts
    over TP once more), of TP with sequence parallelism alone (Megatron's scatter of `[s, b, h]` over the TP ranks
    needs s % TP == 0), `width` itself otherwise. `tp_for_sequence_parallel`: TP, or 1 without sequence
    parallelism. Rows are right-padded to S and the model's outputs cut back to `width` (`models.schedule`);
    a bucketing rule for fewer distinct shapes belongs here too."""
    multiple = (2 * cp_size if cp_size > 1 else 1) * tp_for_sequence_parallel
    return -(-width // multiple) * multiple
