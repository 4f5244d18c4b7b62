"""Guards: a grad-norm spike backs the learning rate off, a KL explosion (with the stage's own threshold) asks for
a rollback, and too many non-finite iterations in a row stop the run — each with a message for the logs."""

from __future__ import annotations

import pytest

from tests.distributed import guard_workers
from tests.distributed.harness import run_distributed


def test_guards_back_off_roll_back_and_stop() -> None:
    report = run_distributed(guard_workers.guards_act, 1)[0]
    before, after = report["lr_before_spike"], report["lr_after_spike"]
    assert all(b > 0 for b in before) and after == pytest.approx([b * 0.5 for b in before]), (before, after)
    assert any("grad norm 50" in e and "learning rate × 0.5" in e for e in report["events"]), report["events"]
    assert not report["rollback_before"]
    assert report["rollback_after_stage_override"], (
        "KL 0.5 is above the stage's threshold 0.4 (base 1.0); the stage's LR factor 0.25 applies"
    )
    assert any("roll back" in e for e in report["events"])
    assert report["too_many_skips"] and "max_consecutive_skips=2" in report["too_many_skips"]
