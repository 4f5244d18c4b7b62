"""What a checkpoint holds of the run (`trainer_state.pt`) is pinned, key by key, so that a change to the trainer's
shape cannot drop or rename a part's state unnoticed; and a checkpoint saved by the trainer of 2026-12-06
(`tests/fixtures/trainer_checkpoint/`, before the loop was split into parts) resumes and is rolled back to."""

from __future__ import annotations

import pytest

from tests.distributed import run_state_workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.floor

# The keys of trainer_state.pt (the checkpoint's run state) and of its parts' entries, as of 2026-12-06
PINNED_KEYS = ["best_checkpoint", "checkpoint/optimizers_saved", "evaluation", "good_checkpoint", "guards", "kl",
               "memory", "normalizer", "sampler", "schedulers", "skipped_steps", "step"]  # fmt: skip
PINNED_NESTED = {
    "sampler": ["dropped_last", "epoch", "num_rows", "position", "seed", "shuffle"],
    "kl": ["loss"],
    "schedulers": ["actor", "critic"],
    "guards": ["best_eval", "consecutive_skips", "evals_since_best", "grad_norms", "losses", "rollbacks", "watching"],
    "memory": ["overrides", "retries"],
}


def test_the_run_state_a_checkpoint_holds_is_pinned(tmp_path) -> None:
    saved = run_distributed(run_state_workers.saved_state, 1, str(tmp_path))[0]
    assert saved["keys"] == PINNED_KEYS
    assert saved["nested"] == PINNED_NESTED


def test_a_checkpoint_of_the_trainer_before_its_parts_resumes_and_is_rolled_back_to(tmp_path) -> None:
    report = run_distributed(run_state_workers.resume_and_roll_back, 1, str(tmp_path))[0]
    assert report["resumed_from"].endswith(f"step_{run_state_workers.FIXTURE_STEP}"), report
    assert report["step_after_resume"] == run_state_workers.FIXTURE_STEP
    assert report["step_after_iteration"] == run_state_workers.FIXTURE_STEP + 1
    assert report["step_after_rollback"] == run_state_workers.FIXTURE_STEP and report["sampler_restored"], report
    assert report["rolled_lr"] == pytest.approx(report["lr"] * 0.5), report
