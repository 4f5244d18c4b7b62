"""The offline dataset: reading and checking rows, chat templates, reward scoring, micro-batching by count or token
budget, epoch sampling."""

from megatron_ppo.data.batching import EpochSampler, dynamic_micro_batches, fixed_micro_batches, padding_fraction
from megatron_ppo.data.chat import ChatTemplate, render_builtin_chat
from megatron_ppo.data.rows import DataError, DataReport, Row, Tokenizer, read_rows
from megatron_ppo.data.scoring import Scorer, build_scorer

__all__ = [
    "ChatTemplate",
    "DataError",
    "DataReport",
    "EpochSampler",
    "Row",
    "Scorer",
    "Tokenizer",
    "build_scorer",
    "dynamic_micro_batches",
    "fixed_micro_batches",
    "padding_fraction",
    "read_rows",
    "render_builtin_chat",
]
