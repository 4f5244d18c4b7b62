"""Submitting, reading and waiting for jobs on the tests' local Slurm (`tests/slurm/conftest.py`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from bench.ports import on_a_free_port
from slurm.local_cluster import LocalSlurm

REPO = Path(__file__).resolve().parents[2]
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def job_env(cluster: LocalSlurm, port: int) -> dict[str, str]:
    """The submitting shell's environment (sbatch passes it to the job) with the job's rendezvous port."""
    return {**cluster.env, "MASTER_PORT": str(port)}


def job_log(logs: Path, job_id: str) -> str:
    found = list(logs.glob(f"*-{job_id}.out"))
    return found[0].read_text() if found else ""


def submitted_until_done(cluster: LocalSlurm, logs: Path, command: list[str], timeout_s: float) -> tuple[str, dict]:
    """`command` (`make submit …` or `python slurm/submit.py …`, one job, run from the repository) and its job waited
    for until it ends; submitted again on another port when its rendezvous found the port taken (another job on this
    machine had it by then): (its id, `scontrol show job`)."""

    def launch(port: int) -> tuple[str, dict]:
        result = subprocess.run(command, cwd=REPO, env=job_env(cluster, port), capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        (job_id,) = re.findall(r"submitted job (\d+)", result.stdout)
        return job_id, cluster.wait_for(job_id, DONE, timeout_s=timeout_s)

    return on_a_free_port(launch, log=lambda done: "" if done[1]["JobState"] == "COMPLETED" else job_log(logs, done[0]))
