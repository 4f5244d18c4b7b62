"""Reading an MLflow run back beside the TensorBoard files of the same run (the MLflow logger's tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_ppo.runs.report import load_run


def assert_same_scalars(client: Any, mlflow_run: Any, tensorboard_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard holds of a run is in its MLflow run under the same name, with the same values at the
    same steps, each write of a step (a rollback's replay too) once; TensorBoard's writes, by tag (step, value)."""
    writes = {tag: sorted((step, value) for _, step, value in w) for tag, w in load_run(tensorboard_dir).writes.items()}
    assert sorted(mlflow_run.data.metrics) == sorted(writes), "MLflow and TensorBoard name other metrics"
    for tag, written in writes.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, tag))
        assert [step for step, _ in history] == [step for step, _ in written], f"{tag}: other steps"
        assert [value for _, value in history] == pytest.approx(
            [value for _, value in written], rel=1e-6, abs=1e-6, nan_ok=True
        )
    return writes
