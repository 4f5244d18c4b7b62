"""The launch path against a real Slurm (munge, slurmctld and two slurmds, two nodes on this host, shared by the Slurm
modules: tests/slurm/conftest.py): `make submit` of the tiny recipe across two nodes (a task each), a failing job,
the time limit's signal → requeue → resume, `scancel`, a chain of two jobs of two tasks on one node (these three
side by side, as jobs share a cluster), and preemption → requeue → resume, alone (it takes every CPU). Skipped, with
the reason, only where Slurm is not installed (`.ci/run` installs it; by hand: `sudo python3 slurm/local_cluster.py
install`)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.ports import free_port, port_taken
from slurm.local_cluster import URGENT_PARTITION, LocalSlurm
from tests.slurm.jobs import DONE, REPO, job_env, job_log, submitted_until_done
from tests.support.tensorboard import scalars

RECIPE = "recipes/tiny-cpu.yaml"
FIRST_STEPS = 6  # of `first_job`, the uninterrupted run a preempted one is compared with: room for the preemption
SIGNALLED_STEPS = 10  # of the jobs signalled once they run (time limit, scancel): room for the signal, under load
NOT_DETERMINISTIC = ("perf/", "timing/")  # wall-clock measurements: the rest of a run's scalars repeat bit for bit
# The tiny recipe cut down to seconds: a small task, a short SFT, small batches (its learning is tested in tests/e2e).
SHORT = [
    "data.addition.num_prompts=200", "data.addition.num_heldout=50", "data.addition.sft_steps=30",
    "data.train_batch_size=64", "actor.ppo_mini_batch_size=32", "actor.ppo_micro_batch_size_per_gpu=32",
    "critic.ppo_mini_batch_size=32", "critic.ppo_micro_batch_size_per_gpu=32", "trainer.test_freq=0",
]  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def submit(cluster: LocalSlurm, logs: Path, overrides: list[str], *extra: str, port: int | None = None) -> list[str]:
    """`python slurm/submit.py` against the cluster; the submitted job ids."""
    command = [sys.executable, "slurm/submit.py", RECIPE, "--log-dir", str(logs), *extra, *SHORT, *overrides]
    env = job_env(cluster, free_port() if port is None else port)
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    return re.findall(r"submitted job (\d+)", result.stdout)


def logged_steps(log: str) -> list[int]:
    """The PPO steps whose metrics line rank 0 printed, in order."""
    return [int(step) for step in re.findall(r" step (\d+): reward", log)]


def wait_for_line(cluster: LocalSlurm, logs: Path, job_id: str, text: str, timeout_s: float = 600) -> bool:
    """Wait until `text` is in the job's log (True), or the job has ended without it (False)."""
    deadline = time.monotonic() + timeout_s
    while text not in job_log(logs, job_id):
        if cluster.job(job_id).get("JobState") in DONE:
            return text in job_log(logs, job_id)
        assert time.monotonic() < deadline, f"{text!r} never appeared; log:\n{job_log(logs, job_id)[-3000:]}"
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def first_job(cluster: LocalSlurm, runs: Path) -> dict:
    """`make submit NODES=2` of the shortened tiny recipe, one task per node (it also prepares the task data the
    later jobs reuse)."""
    logs, overrides = runs / "logs", [f"data.addition.work_dir={runs}/work", *_outputs(runs / "first")]
    overrides += [f"trainer.total_training_steps={FIRST_STEPS}", "trainer.save_freq=2", "cluster.gpus_per_node=1"]
    make = ["make", "--no-print-directory", "submit", f"RECIPE={RECIPE}", f"LOG_DIR={logs}", "NODES=2",
            f"OVERRIDES={' '.join([*SHORT, *overrides])}"]  # fmt: skip

    job_id, job = submitted_until_done(cluster, logs, make, timeout_s=600)
    return {"id": job_id, "job": job, "log": job_log(logs, job_id), "logs": logs, "out": runs / "first"}


def _outputs(root: Path) -> list[str]:
    return [f"trainer.default_local_dir={root}/ckpt", f"trainer.log_dir={root}/tb"]


def test_make_submit_trains_the_tiny_recipe_across_two_nodes(cluster: LocalSlurm, first_job: dict) -> None:
    """The node arithmetic: --nodes=2 --ntasks-per-node=1 from cluster.nodes=2 × gpus_per_node=1; each rank's local
    rank is 0 on its own node, the tensor-parallel pair spans the two, and the rendezvous is on one of them."""
    log, job = first_job["log"], first_job["job"]
    assert job["JobState"] == "COMPLETED" and job["ExitCode"] == "0:0" and job["NumNodes"] == "2", (job, log[-3000:])
    first, second = cluster.nodes
    hosts = {re.search(rf"^{rank}: rank {rank}/2 \(local 0\) on (\S+):", log, re.M)[1] for rank in (0, 1)}
    assert hosts == {first, second}, log[-3000:]
    assert re.search(r"^rendezvous (\S+):", log, re.M)[1] in {first, second}
    assert "trainer exited with status 0" in log
    assert (first_job["out"] / "ckpt" / "latest").read_text().strip() == f"step_{FIRST_STEPS}"
    logged = scalars(first_job["out"] / "tb")
    assert sorted(logged["actor/pg_loss"]) == list(range(1, FIRST_STEPS + 1))
    job_dir = first_job["logs"] / f"ppo-tiny-cpu-{first_job['id']}"
    assert "clip_ratio_c" in (job_dir / "config.yaml").read_text()  # the resolved config is kept with the job


def test_a_failing_job_ends_failed_with_the_error_in_its_log(cluster: LocalSlurm, runs: Path, first_job) -> None:
    logs = runs / "logs"
    sbatch = ["sbatch", "--parsable", "--ntasks=2", f"--output={logs}/%x-%j.out", "--job-name=bad",
              f"--export=ALL,PPO_LOG_ROOT={logs}", "slurm/ppo.sbatch", RECIPE, "actor.clip_ratio_c=0.5"]  # fmt: skip
    job_id = subprocess.run(sbatch, cwd=REPO, env=cluster.env, capture_output=True, text=True, check=True).stdout
    job = cluster.wait_for(job_id.strip(), DONE, timeout_s=120)
    assert job["JobState"] == "FAILED" and job["ExitCode"] == "2:0", job
    assert "actor.clip_ratio_c=0.5: must be > 1" in job_log(logs, job_id.strip())


def started(cluster: LocalSlurm, logs: Path, jobs: list[tuple[list[str], tuple[str, ...]]],
            then: Callable[[str], object] = lambda job_id: None) -> list[str]:  # fmt: skip
    """Jobs submitted with `submit` (overrides, extra arguments) all at once, each waited for until it runs and then
    given to `then`: its trainer's preemption watch is on (it is on before any model is built; a signal before the
    first step is acted on after it), so a signal sent now lands in the first steps of the run, however loaded the
    machine. A job whose rendezvous found its port taken is submitted again on another."""

    def running(job_id: str) -> bool:
        """Waited for until it runs (True), or until it ended: False when its rendezvous found the port taken."""
        return wait_for_line(cluster, logs, job_id, "run step 0:") or not port_taken(job_log(logs, job_id))

    ids = [submit(cluster, logs, overrides, *extra)[0] for overrides, extra in jobs]
    for index, (overrides, extra) in enumerate(jobs):
        for _ in range(2):  # submitted again, on another free port, at most twice
            if running(ids[index]):
                break
            (ids[index],) = submit(cluster, logs, overrides, *extra)
        else:
            running(ids[index])
        then(ids[index])
    return ids


@pytest.fixture(scope="module")
def side_by_side(cluster: LocalSlurm, runs: Path, first_job: dict) -> dict[str, list[str]]:
    """The jobs of the time-limit, `scancel` and chain tests, side by side on the two nodes (a job of two tasks on
    each; the chain's first when one frees): the time limit's SIGUSR1 and `scancel` sent once their jobs run; the
    chain's second job waits on its first (afterok)."""
    logs, work = runs / "logs", f"data.addition.work_dir={runs}/work"
    scancel = iter([["--signal=USR1"], []])  # the first job the time limit's warning, the second a plain scancel
    time_limit, cancelled = started(cluster, logs, [
        ([work, *_outputs(runs / "preempted"), f"trainer.total_training_steps={SIGNALLED_STEPS}"], ()),
        ([work, *_outputs(runs / "cancelled"), f"trainer.total_training_steps={SIGNALLED_STEPS}"], ()),
    ], then=lambda job: subprocess.run(["scancel", *next(scancel), job], env=cluster.env, check=True))  # fmt: skip
    chain_overrides = [work, *_outputs(runs / "chain"), "trainer.total_training_steps=6", "trainer.exit_interval=3"]
    chain = submit(cluster, logs, chain_overrides, "--chain", "2")
    assert cluster.job(chain[1])["Dependency"].startswith(f"afterok:{chain[0]}"), cluster.job(chain[1])
    return {"time limit": [time_limit], "cancelled": [cancelled], "chain": chain}


def test_the_time_limit_signal_checkpoints_requeues_and_resumes(
    cluster: LocalSlurm, runs: Path, side_by_side: dict
) -> None:
    """SIGUSR1 as `#SBATCH --signal=USR1@120` sends it before the time limit (here by `scancel --signal`, which
    leaves the job RUNNING as the warning does): the trainer saves, the batch script requeues, the job resumes."""
    logs, out, (job_id,) = runs / "logs", runs / "preempted", side_by_side["time limit"]
    job = cluster.wait_for(job_id, DONE, timeout_s=600)
    log = job_log(logs, job_id)
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", (job, log[-3000:])
    saved = re.search(r"stopped early: saved \S+/step_(\d+); exiting with 75", log)
    assert saved, log[-3000:]
    assert f"requeueing job {job_id}" in log
    requeued = log.split("(restart 1)")[1]
    assert "resumed from" in requeued and logged_steps(requeued)[0] == int(saved.group(1)) + 1, log[-3000:]
    assert (out / "ckpt" / "latest").read_text().strip() == f"step_{SIGNALLED_STEPS}"
    assert sorted(scalars(out / "tb")["actor/pg_loss"]) == list(range(1, SIGNALLED_STEPS + 1))  # none lost, none twice


def test_scancel_saves_and_stops_the_job_for_good(cluster: LocalSlurm, runs: Path, side_by_side: dict) -> None:
    """`scancel JOBID` of a running job: SIGTERM as a preemption sends it, but the job is CANCELLED: the trainer
    saves within KillWait, and the batch script does not requeue it."""
    logs, out, (job_id,) = runs / "logs", runs / "cancelled", side_by_side["cancelled"]
    cluster.wait_for(job_id, DONE, timeout_s=300)
    time.sleep(3)  # a requeued job would be back in PENDING (Restarts=1) by now
    job, log = cluster.job(job_id), job_log(logs, job_id)
    assert job["JobState"] == "CANCELLED" and job["Restarts"] == "0", (job, log[-3000:])
    saved = re.search(r"stopped early: saved \S+/step_(\d+); exiting with 75", log)
    assert saved, log[-3000:]  # saved first
    assert f"cancelled: job {job_id} is not requeued" in log and "requeueing" not in log, log[-3000:]
    assert (out / "ckpt" / "latest").read_text().strip() == f"step_{saved.group(1)}"


def test_a_chain_of_two_jobs_continues_where_the_first_stopped(cluster: LocalSlurm, runs: Path, side_by_side) -> None:
    """`submit.py --chain 2`: the second job depends on the first (afterok, checked at submission) and resumes where
    the first stopped at its job budget."""
    logs, out, (first, second) = runs / "logs", runs / "chain", side_by_side["chain"]
    jobs = [cluster.wait_for(job_id, DONE, timeout_s=600) for job_id in (first, second)]
    logs_text = [job_log(logs, job_id) for job_id in (first, second)]
    assert [job["JobState"] for job in jobs] == ["COMPLETED", "COMPLETED"], logs_text[1][-3000:]
    for rank in (0, 1):  # two tasks on one node: local ranks 0 and 1
        assert re.search(rf"^{rank}: rank {rank}/2 \(local {rank}\) on ", logs_text[0], re.M), logs_text[0][-3000:]
    assert "exiting with 0, the next job resumes" in logs_text[0]
    assert logged_steps(logs_text[0]) == [1, 2, 3] and logged_steps(logs_text[1]) == [4, 5, 6]
    assert "resumed from" in logs_text[1]
    assert jobs[1]["StartTime"] >= jobs[0]["EndTime"]
    assert (out / "ckpt" / "latest").read_text().strip() == "step_6"
    assert sorted(scalars(out / "tb")["actor/pg_loss"]) == list(range(1, 7))


def test_preemption_requeues_and_the_job_resumes_bit_exact(
    cluster: LocalSlurm, runs: Path, first_job: dict, side_by_side: dict
) -> None:
    """A job of partition `urgent` (higher PriorityTier, PreemptMode=REQUEUE) takes every CPU from the running job:
    Slurm requeues it itself after SIGTERM, the trainer having saved; the requeued job resumes from that checkpoint
    and its steps are bit for bit those of `first_job`, the same run never interrupted."""
    for job_id in (job_id for jobs in side_by_side.values() for job_id in jobs):  # the urgent job would take theirs
        cluster.wait_for(job_id, DONE, timeout_s=900)
    logs, out = runs / "logs", runs / "preempted-by-priority"
    overrides = [f"data.addition.work_dir={runs}/work", *_outputs(out), f"trainer.total_training_steps={FIRST_STEPS}",
                 "trainer.save_freq=2", "cluster.gpus_per_node=1"]  # fmt: skip
    (job_id,) = started(cluster, logs, [(overrides, ("--nodes", "2"))])
    urgent = ["sbatch", "--parsable", f"--partition={URGENT_PARTITION}", "--nodes=2", "--ntasks-per-node=2",
              "--output=/dev/null", "--wrap=true"]  # fmt: skip
    urgent_id = subprocess.run(urgent, env=cluster.env, capture_output=True, text=True, check=True).stdout.strip()
    job = cluster.wait_for(job_id, DONE, timeout_s=300)
    log = job_log(logs, job_id)
    assert cluster.wait_for(urgent_id, DONE, timeout_s=60)["JobState"] == "COMPLETED"
    assert job["JobState"] == "COMPLETED" and job["Restarts"] == "1", (job, log[-3000:])
    assert "DUE TO PREEMPTION" in log, log[-3000:]
    saved = re.search(r"stopped early: saved \S+/step_(\d+); exiting with 75", log)
    assert saved and f"preempted: Slurm requeues job {job_id}" in log and "requeueing" not in log, log[-3000:]
    requeued = log.split("(restart 1)")[1]
    assert "resumed from" in requeued and logged_steps(requeued)[0] == int(saved.group(1)) + 1, log[-3000:]
    resumed, uninterrupted = scalars(out / "tb"), scalars(first_job["out"] / "tb")
    compared = [tag for tag in uninterrupted if not tag.startswith(NOT_DETERMINISTIC)]
    assert {"actor/pg_loss", "critic/vf_loss"} <= set(compared)
    assert {tag: resumed[tag] for tag in compared} == {tag: uninterrupted[tag] for tag in compared}
