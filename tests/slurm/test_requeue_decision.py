"""`slurm/ppo.sbatch`'s choice after the trainer saved and exited 75 (the preemption marker written): requeue the job
or not, from the job's record at slurmctld — every row of the table in docs/slurm.md, with stand-ins for `srun`
and `scontrol` on PATH, so that it runs without Slurm (the real daemons play a cancel, a preemption and the time
limit's warning in test_slurm_jobs.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# `scontrol show job --oneliner` of a running job, its fields of interest left to each case
RECORD = ("JobId=7 JobName=ppo UserId=root(0) JobState={state} Reason={reason} Dependency=(null) Requeue=1 "
          "Restarts={restarts} BatchFlag=1 PreemptEligibleTime=2026-12-06T07:06:37 PreemptTime={preempt_time} "
          "Partition=local")  # fmt: skip
STAND_INS = {
    # the tasks: the trainer saved, wrote the marker and exited 75
    "srun": 'echo saved > "$MEGATRON_PPO_PREEMPTED_MARKER"; exit 75',
    "scontrol": """case "$1 $2" in
    "show hostnames") echo node1 ;;
    "show job") echo "$FAKE_RECORD" ;;
    "requeue "*) echo "$2" >> "$FAKE_REQUEUED" ;;
esac""",
    "python": 'echo "config of $*"',  # `validate` passes
}


@pytest.mark.parametrize(
    ("state", "reason", "restarts", "preempt_time", "requeued"),
    [
        ("COMPLETING", "None", 0, "None", False),  # scancel
        ("COMPLETING", "None", 1, "2026-12-06T07:17:29", False),  # preempted, PreemptMode=REQUEUE: Slurm requeues it
        ("RUNNING", "None", 0, "None", True),  # --signal=USR1@120 before the time limit, or scancel --signal
        ("COMPLETING", "TimeLimit", 0, "None", True),  # the time limit reached before the save ended
        ("RUNNING", "None", 0, "2026-12-06T07:17:29", True),  # a preemption's GraceTime warning
        ("COMPLETING", "None", 0, "2026-12-06T07:17:29", True),  # preempted, PreemptMode=CANCEL
    ],
)
def test_the_batch_script_requeues_unless_the_job_was_cancelled(
    tmp_path: Path, state: str, reason: str, restarts: int, preempt_time: str, requeued: bool
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    requeues = tmp_path / "requeued"
    env = {
        **os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
        "PPO_LOG_ROOT": str(tmp_path / "logs"), "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "0",
        "SLURM_JOB_NAME": "ppo", "FAKE_REQUEUED": str(requeues),
        "FAKE_RECORD": RECORD.format(state=state, reason=reason, restarts=restarts, preempt_time=preempt_time),
    }  # fmt: skip
    result = subprocess.run(["bash", "slurm/ppo.sbatch", "recipes/tiny-cpu.yaml"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    out = result.stdout + result.stderr
    assert (requeues.read_text().split() if requeues.exists() else []) == (["7"] if requeued else []), out
    if requeued or restarts:
        assert result.returncode == 0 and "cancelled" not in out, out
    else:
        assert result.returncode == 75 and "cancelled: job 7 is not requeued" in out, out
    assert not (tmp_path / "logs" / "ppo-7" / "preempted").exists()  # the marker is not left for the next run
