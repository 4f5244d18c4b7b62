"""The GPU check's part (h) gate (`gpu_check/layouts.py`): one layout's numbers against TP=1's pass within the
dtype's tolerance and fail beyond it, padding positions aside; fewer than 2 GPUs skip the part without failing it."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from gpu_check.layouts import (
    PASSES,
    ROLES,
    TOLERANCES,
    UPDATE_METRICS,
    compare,
    layouts_table_lines,
    recipe_table_lines,
    weight_difference,
)


def reference_run() -> dict:
    """A TP=1 run's record: log-probs and values over 4 rows × 10 positions, the last 3 of each row padding."""
    generator = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 10)
    mask[:, 7:] = 0
    passes = {key: -torch.rand(4, 10, generator=generator) * 12 for key in PASSES}
    passes["values"] = torch.randn(4, 10, generator=generator)
    metrics = {key: 0.5 + index for index, key in enumerate(UPDATE_METRICS)}
    metrics["actor/pg_loss"] = 0.0  # whitened advantages at ratio 1: the absolute floor decides
    return {"passes": passes, "mask": mask, "metrics": metrics}


NO_WEIGHT_DIFFERENCE = dict.fromkeys(ROLES, 0.0)


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
def test_an_identical_run_passes_and_padding_is_not_compared(dtype: str) -> None:
    reference = reference_run()
    ours = copy.deepcopy(reference)
    ours["passes"]["old_log_prob"][:, 7:] += 100.0  # padding positions hold whatever the model gave there
    result = compare(reference, ours, NO_WEIGHT_DIFFERENCE, TOLERANCES[dtype])
    assert result["ok"] and not result["failures"], result["failures"]
    assert result["passes"]["old_log_prob"]["max"] == 0.0


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("key", PASSES)
def test_one_token_beyond_the_largest_relative_difference_fails(dtype: str, key: str) -> None:
    tolerance, reference = TOLERANCES[dtype], reference_run()
    ours = copy.deepcopy(reference)
    within, beyond = copy.deepcopy(ours), ours
    scale = max(abs(float(reference["passes"][key][1, 3])), 1.0)
    mean_bound, max_bound = tolerance.experience(key)
    within["passes"][key][1, 3] += 0.5 * min(mean_bound, max_bound) * scale
    beyond["passes"][key][1, 3] += 3 * max_bound * scale
    assert compare(reference, within, NO_WEIGHT_DIFFERENCE, tolerance)["ok"]
    result = compare(reference, beyond, NO_WEIGHT_DIFFERENCE, tolerance)
    assert not result["ok"] and result["failures"][0].startswith(f"{key}:"), result["failures"]


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("key", PASSES)
def test_a_drift_of_every_token_beyond_the_mean_fails(dtype: str, key: str) -> None:
    tolerance, reference = TOLERANCES[dtype], reference_run()
    mean_bound, _ = tolerance.experience(key)
    ours = copy.deepcopy(reference)
    x = reference["passes"][key]
    ours["passes"][key] = x + 2 * mean_bound * x.abs().clamp(min=1.0)
    result = compare(reference, ours, NO_WEIGHT_DIFFERENCE, tolerance)
    assert not result["ok"] and result["passes"][key]["mean"] > mean_bound, result["failures"]


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("key", UPDATE_METRICS)
def test_an_update_metric_beyond_its_tolerance_fails(dtype: str, key: str) -> None:
    tolerance, reference = TOLERANCES[dtype], reference_run()
    expected = reference["metrics"][key]
    bound = max(tolerance.metric_rel * abs(expected), tolerance.metric_abs)
    for offset, passes in ((0.5 * bound, True), (-0.5 * bound, True), (2 * bound, False), (math.nan, False)):
        ours = copy.deepcopy(reference)
        ours["metrics"][key] = expected + offset
        result = compare(reference, ours, NO_WEIGHT_DIFFERENCE, tolerance)
        assert result["ok"] is passes, (key, offset, result["failures"])
        if not passes:
            assert result["failures"] == [f"{key}: {expected + offset:.6g} vs {expected:.6g}"]


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("role", ROLES)
def test_weights_beyond_their_tolerance_fail(dtype: str, role: str) -> None:
    tolerance, reference = TOLERANCES[dtype], reference_run()
    assert compare(reference, reference, {**NO_WEIGHT_DIFFERENCE, role: 0.5 * tolerance.weights}, tolerance)["ok"]
    result = compare(reference, reference, {**NO_WEIGHT_DIFFERENCE, role: 2 * tolerance.weights}, tolerance)
    assert not result["ok"] and result["failures"][0].startswith(f"{role} weights")


def test_weight_difference_is_the_relative_norm_over_every_tensor() -> None:
    reference = {"a": torch.full((3,), 2.0), "b": torch.zeros(2, 2)}  # ‖w₁‖ = √12
    ours = {"a": torch.full((3,), 2.0), "b": torch.tensor([[1.0, 0.0], [0.0, 1.0]])}  # ‖Δw‖ = √2
    assert weight_difference(ours, reference) == pytest.approx(math.sqrt(2 / 12), rel=1e-12)
    with pytest.raises(KeyError, match="other tensors"):
        weight_difference({"a": reference["a"]}, reference)


def test_a_skipped_part_reads_as_skipped_in_the_table() -> None:
    """The driver's result for (h) where fewer GPUs are visible (`tests/unit/test_gpu_check_sizing.py` runs the
    driver): one line each, naming what is visible and what it needs."""
    skipped = {"skipped": "1 GPU visible", "ok": True, "wall_s": 0.0}
    lines = layouts_table_lines(skipped) + recipe_table_lines(skipped)
    assert len(lines) == 2 and all("skipped: 1 GPU visible (needs 2)" in line for line in lines), lines
