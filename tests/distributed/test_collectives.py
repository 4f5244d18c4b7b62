"""Per-row tensors gathered over data-parallel ranks come back whole and in their original order."""

from __future__ import annotations

import torch

from tests.distributed import collective_workers
from tests.distributed.harness import run_distributed


def test_rows_gathered_over_uneven_data_parallel_shares_are_in_order() -> None:
    expected = torch.arange(collective_workers.ITEMS * collective_workers.WIDTH, dtype=torch.float32)
    expected = expected.view(collective_workers.ITEMS, collective_workers.WIDTH).tolist()
    for rank, rows in enumerate(run_distributed(collective_workers.gather_rows, 2)):
        assert rows == expected, f"rank {rank} gathered {rows}, expected every row in order"
