"""The tiny task's SFT and sampling run data-parallel (`recipe.task_layout`), whatever the PPO run's layout: the
process groups switch for the build and back after it, and the run draws the same random numbers next whether it
built the task or found it cached. (That the SFT policy loads at the run's layout and trains is the end-to-end tests'
business: every tiny run starts from it.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import task_workers
from tests.distributed.harness import run_distributed

PP2 = [f"{role}.megatron.{key}" for role in ("actor", "ref", "critic")
       for key in ("tensor_model_parallel_size=1", "pipeline_model_parallel_size=2")]  # fmt: skip


@pytest.mark.parametrize(("layout", "groups"), [([], (2, 1, 1)), (PP2, (1, 2, 1))], ids=["tp2", "pp2"])
def test_the_task_is_built_data_parallel_and_the_run_layout_comes_back(
    layout: list[str], groups: tuple[int, int, int], tmp_path: Path
) -> None:
    results = run_distributed(task_workers.built_then_found, 2, tmp_path, layout)
    for rank, result in enumerate(results):
        assert result["run"] == groups, (rank, result)
        assert result["task"] == (1, 1, 2), f"rank {rank}: the task's groups (TP, PP, DP) were {result['task']}"
        assert result["restored"] == result["after_prepare"] == groups, (rank, result)
        assert result["rng_as_seeded"] == [True, True], f"rank {rank}: the RNG after building, finding the task"
        assert result["rows"] > 0 and Path(result["sft"]).name == "step_8", result
