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


def test_rollbacks_into_one_checkpoint_compound_their_back_offs_and_each_replay_differs(tmp_path) -> None:
    """Three rollbacks into one checkpoint: the learning rates × 0.5, 0.25, 0.125 (each rollback lowers the back-off
    the run had reached, not the checkpoint's), so no two replays of the step are alike (before, every rollback
    restored the checkpoint's rate and halved it once: replays 2 and 3 were identical to the digit); a fourth is
    refused with `guards.max_rollbacks` reached, a guard stop naming the good checkpoint."""
    report = run_distributed(run_state_workers.rollbacks_into_one_checkpoint, 1, str(tmp_path), 1e-6)[0]
    assert report["steps"] == [2, 2, 2, 2], "each iteration ran step 2 (no guard of its own rolled it back)"
    assert report["backoffs"] == [0.5, 0.25, 0.125], report["backoffs"]
    replays = report["replays"]
    assert all(replays[i] != replays[j] for i in range(4) for j in range(i)), replays
    assert "guards.max_rollbacks=3 reached" in report["stopped"] and "step_1" in report["stopped"], report["stopped"]


def test_a_rollback_that_cannot_lower_the_rates_stops_instead_of_replaying(tmp_path) -> None:
    """At `guards.min_lr_fraction=0.5` the first rollback halves the rates to the floor; a second could not lower
    them and would replay the same steps with the same settings: the run stops, saying so."""
    report = run_distributed(run_state_workers.rollbacks_into_one_checkpoint, 1, str(tmp_path), 0.5)[0]
    assert report["backoffs"] == [0.5] and len(report["replays"]) == 2, report
    assert "a rollback would replay the same steps with the same settings" in report["stopped"], report["stopped"]


def test_a_resume_into_a_model_of_another_shape_is_refused_before_it_is_built(tmp_path) -> None:
    """`model.hidden_size` changed between jobs of one run: a `ConfigError` naming it with both values (the resume
    used to die inside Megatron's load with `Global shape mismatch`)."""
    message = run_distributed(run_state_workers.resume_with_another_width, 1, str(tmp_path))[0]
    assert "model.hidden_size: the config builds 64" in message and "step_1" in message, message


def test_a_shard_torchs_reader_fails_on_is_the_checkpoints_error_not_a_traceback(tmp_path) -> None:
    """A shard cut in half in a checkpoint without a manifest: torch's reader raises its `CheckpointException`, a
    `BaseException` that went past every handler (pages of traceback, not even the "bug" line); now a
    `CheckpointError` naming the checkpoint, what was read and the first failing rank's error."""
    message = run_distributed(run_state_workers.resume_damaged_without_manifest, 1, str(tmp_path))[0]
    assert "step_1 cannot be read (the models' and optimizers' shards:" in message, message
    assert "resume from another one" in message, message
