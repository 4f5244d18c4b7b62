"""The KL probe (`algorithm.kl_ctrl.feedback: probe`, train/kl_probe.py) through the trainer, in the tiny recipe's
tensor-parallel layout and in a pipeline-parallel one: its reading after update n is the KL of the policy that update
left, on its fixed rows. With one batch of all the rows and a probe of all of them, the next iteration's batch
`kl/mean` (taken before its own update) measures the same policy on the same rows, so the two must agree; and the
controller reads the probe, whose tracking error is logged against the target. A critic warm-up step, which leaves
the policy (and whose actor weights may be off the device under offload), measures no probe."""

from __future__ import annotations

import itertools
import math

import pytest

from tests.distributed import update_workers
from tests.distributed.harness import run_distributed

# Also run against the oldest megatron-core admitted (`make test-floor`).
pytestmark = pytest.mark.floor

ROLES = ("actor", "ref", "critic")
LAYOUTS = {
    "tp2": [],  # the tiny recipe's own
    "pp2": [f"{role}.megatron.{key}={value}" for role in ROLES
            for key, value in (("tensor_model_parallel_size", 1), ("pipeline_model_parallel_size", 2))],
}  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_probe_after_an_update_reads_what_the_next_batch_measures_on_the_same_rows(tmp_path, layout) -> None:
    report = run_distributed(update_workers.kl_probe_through_the_trainer, 2, str(tmp_path), LAYOUTS[layout])[0]
    assert report["probe_rows"] == 32, "probe_rows above the data's size takes every row"
    warmup, *history = report["history"]
    assert warmup["kl/mean"] == history[0]["kl/mean"] == 0.0, "the reference starts as a copy of the actor"
    assert "kl/probe_mean" not in warmup, "a critic warm-up leaves the policy: nothing new for the probe to read"
    for before, after in itertools.pairwise(history):
        probe, batch = before["kl/probe_mean"], after["kl/mean"]
        assert probe > 1e-4, f"an update at lr 1e-3 moves the policy off the reference: {probe}"
        assert math.isclose(probe, batch, rel_tol=1e-5), f"probe {probe} vs the next batch's kl/mean {batch}"
        assert math.isclose(before["kl/tracking_error"], abs(probe / before["kl/target"] - 1), rel_tol=1e-9)
        assert before["timing/kl_probe_s"] > 0
