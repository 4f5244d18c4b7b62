"""Spawned-rank code for the data-parallel row gather."""

from __future__ import annotations

import torch

from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.parallel import init_distributed
from megatron_ppo.parallel.collectives import data_parallel_share, gather_rows_data_parallel

ITEMS, WIDTH = 7, 5


def gather_rows(rank: int, world_size: int) -> list[list[float]]:
    init_distributed(MegatronConfig(), seed=0)
    every_row = torch.arange(ITEMS * WIDTH, dtype=torch.float32).view(ITEMS, WIDTH)
    mine = every_row[data_parallel_share(ITEMS)]
    return gather_rows_data_parallel(mine, ITEMS).tolist()
