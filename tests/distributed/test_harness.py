"""The launcher the distributed tier runs on: a rank that crashes fails the launch at once with its exit status and
stack, one that does not answer fails it at the timeout with its stack, and neither holds the suite."""

from __future__ import annotations

import signal
import time

import pytest

from tests.distributed import harness_workers
from tests.distributed.harness import run_distributed


@pytest.fixture(autouse=True)
def started_forkserver() -> None:
    """The forkserver up (its preload takes seconds, more on a loaded machine): the timings below are the launch's."""
    assert run_distributed(harness_workers.answers, 2) == [0, 1]


def test_a_crashed_rank_fails_the_launch_at_once_with_its_exit_status_and_stack() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError) as failure:
        run_distributed(harness_workers.rank1_aborts, 2, timeout_s=300)
    report = str(failure.value)
    assert f"ranks [1] exited without answering (exit codes rank 1: {-signal.SIGABRT})" in report, report
    assert "Fatal Python error: Aborted" in report and "in rank1_aborts" in report, report
    assert time.monotonic() - started < 150, "the crash must not wait for the 300 s timeout"


def test_a_silent_rank_fails_at_the_timeout_with_its_stack() -> None:
    with pytest.raises(AssertionError) as failure:
        run_distributed(harness_workers.rank0_sleeps, 2, timeout_s=10)
    report = str(failure.value)
    assert "no answer within 10 s from ranks [0]" in report and "in rank0_sleeps" in report, report
