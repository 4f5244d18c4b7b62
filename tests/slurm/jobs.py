"""Reading and waiting for jobs on the tests' local Slurm (`tests/slurm/conftest.py`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from bench.ports import on_a_free_port
from slurm.local_cluster import LocalSlurm

DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


def job_env(cluster: LocalSlurm, port: int) -> dict[str, str]:
    """The submitting shell's environment (sbatch passes it to the job) with the job's rendezvous port."""
    return {**cluster.env, "MASTER_PORT": str(port)}


def job_log(logs: Path, job_id: str) -> str:
    found = list(logs.glob(f"*-{job_id}.out"))
    return found[0].read_text() if found else ""


def until_done(cluster: LocalSlurm, logs: Path, submit_one: Callable[[int], str], timeout_s: float) -> tuple[str, dict]:
    """`submit_one(port)` (a job id) waited for until it ends; submitted again on another port when its rendezvous
    found the port taken (another job on this machine had it by then): (its id, `scontrol show job`)."""

    def launch(port: int) -> tuple[str, dict]:
        job_id = submit_one(port)
        return job_id, cluster.wait_for(job_id, DONE, timeout_s=timeout_s)

    return on_a_free_port(launch, log=lambda done: "" if done[1]["JobState"] == "COMPLETED" else job_log(logs, done[0]))
