"""The critic's scalar head, standing in for the vocabulary output layer on the last pipeline stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig


class ValueHead(torch.nn.Module):
    """V(h) = h·wᵀ + b, w `[1, hidden]`, replicated on every tensor-parallel rank.

    Holds `weight` and `bias` directly (a nested `nn.Linear` breaks Megatron's `sharded_state_dict()`), and is
    called like Megatron's output layer: `(hidden [s, b, h], weight=None, ...) -> (values [s, b, 1], None)`.
    With sequence parallelism the sequence shards are gathered first, so every TP rank sees every token.
    Starts at zero (V ≡ 0): the same start under every parallel layout, whatever random draws the trunk's
    initialisation made on this rank, and no arbitrary baseline in the first advantages.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        self.weight = torch.nn.Parameter(torch.zeros(1, config.hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None, **_) -> tuple[torch.Tensor, None]:
        if self.sequence_parallel:
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight, self.bias), None
