"""Checkpoints are published atomically, an unfinished or broken one is never resumed from, old ones are pruned."""

from __future__ import annotations

from tests.distributed import checkpoint_workers
from tests.distributed.harness import run_distributed


def test_resume_skips_unfinished_and_broken_checkpoints(tmp_path) -> None:
    report = run_distributed(checkpoint_workers.publish_and_recover, 1, str(tmp_path))[0]
    assert report["after_two_saves"] == "step_2"
    assert report["with_a_half_written_save"] == "step_2", "a .tmp save must never be resumed from"
    assert report["restored_step"] == 2 and report["weights_restored"]
    assert report["with_step_2_broken"] == "step_1", "latest names a broken checkpoint: fall back to the previous one"
    # keep=1 prunes complete checkpoints only; the broken step_2 is left for a person to inspect
    assert report["kept_after_prune"] == ["step_2", "step_4"]
