"""Data parallelism with Megatron's overlapped gradient reduce and parameter all-gather (the distributed
optimizer) over gloo: the out-of-memory back-off recovers from an error in the last micro-batch's backward and
equals a run without it, and a checkpoint holds the step's weights, not the ones before the pending all-gather."""

from __future__ import annotations

import math

import pytest
import torch

from tests.distributed import overlap_workers, workers
from tests.distributed.harness import run_distributed


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    workdir = str(tmp_path_factory.mktemp("overlap"))
    run_distributed(workers.reference, 1, workdir)  # the initial weights (and the TP1 reference)
    # two mini-batches: the error comes in the second one's last backward, after the first one's optimizer step
    return {inject: run_distributed(overlap_workers.overlapped_update, 2, workdir, inject, 2)
            for inject in (True, False)}  # fmt: skip


def test_overlap_is_on_over_gloo(runs) -> None:
    for report in runs[False] + runs[True]:
        assert report["overlap"] == (True, True), "grad reduce and param gather overlap must run on CPU too"


def test_out_of_memory_in_a_backward_is_retried_and_equals_a_run_without_it(runs) -> None:
    """Mid-phase, after a mini-batch has stepped: the failed mini-batch alone runs again, from zeroed gradients —
    one optimizer and schedule step per mini-batch — and the weights equal a run that never failed, at the smaller
    micro-batch."""
    mini_batches = 2
    for faulty, clean in zip(runs[True], runs[False], strict=True):
        assert faulty["raised"] == 1 and faulty["retries"] == 1, faulty
        assert faulty["overrides"] == {"actor.ppo_micro_batch_size_per_gpu": 1}, faulty["overrides"]
        steps = (faulty["optimizer_steps"], faulty["schedule_steps"])
        assert steps == (clean["optimizer_steps"], clean["schedule_steps"]) == (mini_batches,) * 2, steps
        assert math.isclose(faulty["grad_norm"], clean["grad_norm"], rel_tol=1e-6), (faulty["grad_norm"],
                                                                                    clean["grad_norm"])  # fmt: skip
        retried, expected = torch.load(faulty["weights"]), torch.load(clean["weights"])
        diff = max(float((v - expected[k]).abs().max()) for k, v in retried.items())
        assert diff < 1e-6, f"weights after the retried step differ from a run without the fault by {diff:.2e}"


def test_checkpoint_holds_the_weights_of_the_step_not_the_pending_gather(runs) -> None:
    for report in runs[False]:
        assert report["stale_before_sync"], "the overlapped all-gather should still be pending after the step"
        assert report["saved_equals_synced"], "the checkpoint must hold the step's weights (sync_parameters)"
