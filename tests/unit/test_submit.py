"""The Slurm submit wrapper: sizes the job from the recipe, validates the layout for the node count first, passes
overrides as separate arguments, and chains jobs with afterok dependencies; and the trainer's side of it (the job
budget that ends each chained job, the preemption watch)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_ppo.config import ConfigError
from megatron_ppo.train.preemption import MARKER_ENV, JobBudget, StoppedBeforeTraining, watching
from slurm.submit import chain_overrides, main, sbatch_command, time_limit_minutes

REPO = Path(__file__).resolve().parents[2]


def test_job_is_sized_from_the_cluster_section() -> None:
    command = sbatch_command(
        str(REPO / "recipes" / "qwen2.5-32b.yaml"), ["cluster.partition=gpu", "cluster.account=rl"]
    )
    assert command[:2] == ["sbatch", "--parsable"]
    for flag in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--account=rl"):
        assert flag in command
    assert command[-3:] == [str(REPO / "recipes" / "qwen2.5-32b.yaml"), "cluster.partition=gpu", "cluster.account=rl"]


def test_cpu_recipe_asks_for_no_gpus() -> None:
    command = sbatch_command(str(REPO / "recipes" / "tiny-cpu.yaml"), [])
    assert "--ntasks-per-node=2" in command and not any(c.startswith("--gpus") for c in command)


def test_an_impossible_node_count_is_refused_before_submitting() -> None:
    with pytest.raises(ConfigError, match="world size 24"):
        sbatch_command(str(REPO / "recipes" / "qwen2.5-32b.yaml"), ["cluster.nodes=3"])


def test_override_with_spaces_stays_one_argument() -> None:
    command = sbatch_command(str(REPO / "recipes" / "tiny-cpu.yaml"), ["trainer.experiment_name=a b"])
    assert command[-1] == "trainer.experiment_name=a b"


def test_the_scoring_job_runs_score_on_the_recipes_nodes(capsys) -> None:
    assert main([str(REPO / "recipes" / "qwen2.5-32b.yaml"), "--score", "--dry-run"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert "PPO_COMMAND=score" in line and "--nodes=4" in line and "--job-name=score-" in line
    assert "PPO_COMMAND=train" in shlex.join(sbatch_command(str(REPO / "recipes" / "qwen2.5-32b.yaml"), []))
    assert main([str(REPO / "recipes" / "qwen2.5-32b.yaml"), "--score", "--chain", "2", "--dry-run"]) == 2


def test_dry_run_chain_prints_dependent_jobs(capsys) -> None:
    assert main([str(REPO / "recipes" / "tiny-cpu.yaml"), "--dry-run", "--chain", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "--dependency" not in lines[0]
    assert all("--dependency=afterok:" in line for line in lines[1:])


def test_dry_run_of_the_32b_recipe_on_4_nodes_prints_the_sbatch_line(capsys) -> None:
    recipe = str(REPO / "recipes" / "qwen2.5-32b.yaml")
    assert main([recipe, "--nodes", "4", "--dry-run", "cluster.partition=gpu"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert shlex.split(line) == [
        "sbatch", "--parsable", "--nodes=4", "--ntasks-per-node=8", "--time=04:00:00", "--job-name=ppo-qwen2.5-32b",
        "--output=logs/%x-%j.out", "--export=ALL,PPO_LOG_ROOT=logs,PPO_COMMAND=train", "--gpus-per-node=8",
        "--partition=gpu",
        str(REPO / "slurm" / "ppo.sbatch"), recipe, "cluster.partition=gpu", "cluster.nodes=4",
    ]  # fmt: skip


def test_an_invalid_node_count_is_refused_with_the_reason(capsys) -> None:
    assert main([str(REPO / "recipes" / "qwen2.5-32b.yaml"), "--nodes", "3", "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert "sbatch" not in captured.out and "world size 24" in captured.err


@pytest.mark.parametrize(
    ("limit", "minutes"),
    [("30", 30), ("30:30", 30.5), ("04:00:00", 240), ("1-00", 1440), ("2-01:30", 2970), ("1-00:00:30", 1440.5)],
)
def test_slurm_time_limits(limit: str, minutes: float) -> None:
    assert time_limit_minutes(limit) == minutes


def test_a_chain_stops_each_job_ten_minutes_before_its_limit() -> None:
    recipe = str(REPO / "recipes" / "tiny-cpu.yaml")
    assert chain_overrides(recipe, ["cluster.time_limit=02:00:00"]) == ["trainer.exit_duration_in_mins=110"]
    assert chain_overrides(recipe, ["trainer.exit_interval=50"]) == []
    with pytest.raises(ConfigError, match=r"trainer\.exit_interval"):
        chain_overrides(recipe, ["cluster.time_limit=00:05:00"])


def test_job_budget_stops_on_the_interval_and_after_the_duration() -> None:
    """The duration counts from when this process started (a job's budget includes its set-up), here measured from
    the process's own start time, so the test holds however long the suite has run before it."""
    by_steps = JobBudget(exit_interval=3, exit_duration_in_mins=None)
    assert [by_steps.reason(step) is not None for step in range(1, 7)] == [False, False, True, False, False, True]
    ran_mins = (time.time() - psutil.Process().create_time()) / 60
    assert JobBudget(None, exit_duration_in_mins=ran_mins + 60).reason(1) is None  # an hour left
    assert "exit_duration_in_mins" in JobBudget(None, exit_duration_in_mins=ran_mins / 2).reason(1)  # spent already


def test_a_signal_before_training_stops_at_once_as_a_preemption(tmp_path, monkeypatch) -> None:
    """During set-up (the data, the task's SFT, a conversion: it can outlast the launcher's 30 s grace) there is
    nothing to save: the marker for the batch script, `StoppedBeforeTraining` (exit 75) at once. Before, the signal
    was held until after the first PPO step, and torchrun SIGKILLed the workers first: no message, no marker, no
    requeue. Once the loop has started, a signal is remembered for the iteration's end (its checkpoint)."""
    marker = tmp_path / "preempted"
    monkeypatch.setenv(MARKER_ENV, str(marker))
    before = signal.getsignal(signal.SIGUSR1)
    with watching() as outer:
        with pytest.raises(StoppedBeforeTraining, match="SIGUSR1") as stopped:
            os.kill(os.getpid(), signal.SIGUSR1)  # during set-up
        assert stopped.value.exit_status == 75 and marker.exists()
        with watching() as inner, inner.in_the_loop():  # what PPOTrainer.fit then uses
            assert inner is outer
            os.kill(os.getpid(), signal.SIGUSR1)  # in the loop: remembered, not raised
            assert inner.signalled == signal.SIGUSR1 and inner.agreed()
    assert signal.getsignal(signal.SIGUSR1) == before
    assert outer.ending.finished.is_set(), "the stop unwound: its timer, which would end the process, is off"


def test_without_sbatch_the_wrapper_says_where_to_run(monkeypatch, capsys) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert main([str(REPO / "recipes" / "tiny-cpu.yaml")]) == 1
    assert "sbatch is not on PATH" in capsys.readouterr().err


def test_any_python_runs_the_script_in_the_projects_environment_or_says_how_in_one_line(tmp_path) -> None:
    """`python -S` (no site-packages: a Python without the package, as a cluster's system python3 is) re-executes in
    the checkout's `.venv`; a copy of the script outside any checkout ends in one `error:` line and exit 2 (it was a
    `ModuleNotFoundError` traceback)."""
    script = REPO / "slurm" / "submit.py"
    command = [sys.executable, "-S", str(script), str(REPO / "recipes" / "tiny-cpu.yaml"), "--dry-run"]
    ran = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert ran.returncode == 0 and "sbatch --parsable" in ran.stdout, ran.stderr[-2000:]
    (tmp_path / "slurm").mkdir()
    alone = shutil.copy(script, tmp_path / "slurm" / "submit.py")
    refused = subprocess.run([sys.executable, "-S", alone, "x.yaml"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, check=False)  # fmt: skip
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert refused.stderr.startswith("error: slurm/submit.py runs in megatron-ppo's environment"), refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.splitlines()) == 1, refused.stderr
