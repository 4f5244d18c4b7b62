"""One writer per run directory (`checkpoint/lock.py`): a live holder in another process refuses a second job by
name; a holder killed without releasing is taken over and said; a Slurm requeue of the same job and a clean exit
pass silently."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ppo.checkpoint import lock
from megatron_ppo.checkpoint.lock import RunDirectoryLocked

REPO = Path(__file__).resolve().parents[2]
HOLD = (
    "import sys, time; from megatron_ppo.checkpoint import lock; lock.acquire(sys.argv[1]); print('held', flush=True)"
)


def _holder(directory: Path, job_id: str, then: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": job_id}
    process = subprocess.Popen([sys.executable, "-c", f"{HOLD}; {then}", str(directory)], env=env,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout.readline() == "held\n"
    return process


def test_a_second_job_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "200")
    holder = _holder(tmp_path, "100", "time.sleep(600)")
    try:
        with pytest.raises(RunDirectoryLocked) as refused:
            lock.acquire(tmp_path)
        assert f"in use by another job (pid {holder.pid} on {socket.gethostname()}, Slurm job 100, since" in str(
            refused.value
        )
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the file still names it
        holder.wait()
    taken = lock.acquire(tmp_path)
    assert taken is not None and f"its holder (pid {holder.pid} on {socket.gethostname()}, Slurm job 100" in taken
    assert lock.acquire(tmp_path) is None, "this process holds it already"
    lock.release(tmp_path)
    assert (tmp_path / lock.LOCK_FILE).read_text() == "", "a release leaves no holder named"


def test_a_requeued_job_and_a_clean_exit_take_the_lock_silently(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "300")
    requeued = _holder(tmp_path, "300", "time.sleep(600)")
    requeued.send_signal(signal.SIGKILL)  # Slurm's requeue: the job's processes are killed, the same job id starts
    requeued.wait()
    assert lock.acquire(tmp_path) is None
    lock.release(tmp_path)
    _holder(tmp_path, "400", "pass").wait()  # exits normally: the lock is released at exit
    assert lock.acquire(tmp_path) is None
    lock.release(tmp_path)
