"""The offline dataset: reading and checking rows, micro-batching by count or token budget, epoch sampling."""

from megatron_ppo.data.batching import EpochSampler, dynamic_micro_batches, fixed_micro_batches, padding_fraction
from megatron_ppo.data.rows import DataError, DataReport, Row, Tokenizer, read_rows, render_chat

__all__ = [
    "DataError",
    "DataReport",
    "EpochSampler",
    "Row",
    "Tokenizer",
    "dynamic_micro_batches",
    "fixed_micro_batches",
    "padding_fraction",
    "read_rows",
    "render_chat",
]
