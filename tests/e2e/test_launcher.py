"""`megatron-ppo train --nproc N` as a user launches it: real worker processes under torch's elastic agent, and at
the shell one message and the exit status the workers decided — no launcher traceback, nothing said twice.

Plain `torchrun` (before this launcher, and still) ends each of these with its own `ChildFailedError` page and exit 1
(a config error, a killed peer), or a `SignalException` traceback and exit 1 (Ctrl-C)."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from bench.tiny import RECIPE, REPO
from megatron_ppo.checkpoint.directory import named_by_latest
from megatron_ppo.cli import LIBRARY_NOTICES
from megatron_ppo.train.preemption import MARKER_ENV
from tests.faults.cases import QUICK

# Two processes of data parallelism on the quick run's task cache (the shared SFT start)
TWO = [*QUICK, "cluster.gpus_per_node=2", "trainer.total_training_steps=60", "trainer.resume_mode=disable",
       *(f"{role}.ppo_micro_batch_size_per_gpu=8" for role in ("actor", "critic"))]  # fmt: skip
LAUNCHER_NOISE = ("Traceback", "ChildFailedError", "SignalException", "torch.distributed.elastic")


class Launch:
    """`python -m megatron_ppo train --nproc 2` on the tiny recipe in `folder`, its output read as it comes."""

    def __init__(self, folder: Path, work: Path, *overrides: str, env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "1000", **(env or {})}
        env.pop("MASTER_PORT", None)
        self.folder = folder
        command = [sys.executable, "-m", "megatron_ppo", "train", "--nproc", "2", str(RECIPE), *TWO,
                   f"data.addition.work_dir={work}", f"trainer.default_local_dir={folder}/ckpt",
                   f"trainer.log_dir={folder}/tb", *overrides]  # fmt: skip
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)  # fmt: skip
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self.reader.start()

    def wait_for(self, text: str, timeout_s: float = 600) -> None:
        end = time.monotonic() + timeout_s
        while not any(text in line for line in self.lines):
            assert self.process.poll() is None, f"exited {self.process.returncode} before {text!r}:\n{self.output}"
            assert time.monotonic() < end, f"no {text!r} in {timeout_s} s:\n{self.output}"
            time.sleep(0.2)

    def worker(self, rank: int) -> psutil.Process:
        return next(p for p in psutil.Process(self.process.pid).children(recursive=True)
                    if p.environ().get("RANK") == str(rank))  # fmt: skip

    def end(self) -> int:
        code = self.process.wait(timeout=300)
        self.reader.join(timeout=10)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def _said_once(output: str, text: str) -> None:
    assert output.count(text) == 1, f"{text!r} said {output.count(text)} times:\n{output[-4000:]}"
    assert not any(noise in output for noise in LAUNCHER_NOISE), output[-4000:]


def test_a_layout_the_processes_cannot_run_is_refused_before_any_starts(tmp_path: Path) -> None:
    """TP 3 on 2 processes: the launcher's own validation, one `error:` block, exit 2, no worker started."""
    launch = Launch(tmp_path, tmp_path / "work", *(f"{r}.megatron.tensor_model_parallel_size=3"
                                                   for r in ("actor", "ref", "critic")))  # fmt: skip
    assert launch.end() == 2
    _said_once(launch.output, "error:")
    assert "does not divide the world size 2" in launch.output and "rank 0/2" not in launch.output


def test_an_error_every_worker_finds_is_said_once_with_exit_2(tmp_path: Path) -> None:
    """A checkpoint directory that cannot be written, found by both workers after they start."""
    (tmp_path / "a-file").write_text("")
    launch = Launch(tmp_path, tmp_path / "work", f"trainer.default_local_dir={tmp_path}/a-file/ckpt")
    assert launch.end() == 2
    _said_once(launch.output, "error:")
    assert "cannot be written (Not a directory" in launch.output


def test_a_stop_signal_during_set_up_ends_at_once_with_75_and_the_marker(tmp_path: Path) -> None:
    """Slurm's SIGTERM (a preemption) to the launcher while the task's SFT runs: the workers stop at once (nothing
    new to save), the marker for the batch script written, one line, exit 75 — within the agent's 30 s grace. Before,
    the signal was held until after the first PPO step, the agent SIGKILLed the workers at 30 s: no line, no marker,
    torchrun's exit 1."""
    marker = tmp_path / "preempted"
    launch = Launch(tmp_path, tmp_path / "work", "data.addition.sft_steps=100000", env={MARKER_ENV: str(marker)})
    launch.wait_for("rank 1/2")  # both workers up: the set-up (tokenizer, SFT) has begun
    time.sleep(2)
    signalled = time.monotonic()
    launch.process.send_signal(signal.SIGTERM)
    assert launch.end() == 75, launch.output[-3000:]
    assert time.monotonic() - signalled < 25, "the workers must end within the agent's grace, not be killed at 30 s"
    _said_once(launch.output, "stopped early by SIGTERM before training: nothing new to save")
    assert marker.exists(), "the batch script requeues on the marker"


@pytest.fixture
def training(quick_run: Path, tmp_path: Path):
    """Two workers training from the quick run's task cache, past their first PPO step."""
    launch = Launch(tmp_path, quick_run / "work", "trainer.save_freq=1")
    try:
        launch.wait_for("step 2:")
        yield launch
    finally:
        if launch.process.poll() is None:
            launch.process.kill()
            for child in psutil.Process(launch.process.pid).children(recursive=True):
                child.kill()


def test_ctrl_c_saves_and_ends_130_with_one_resume_command_that_relaunches_alike(training: Launch) -> None:
    training.process.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends the launcher
    assert training.end() == 130
    _said_once(training.output, "interrupted: saved")
    line = next(line for line in training.lines if line.startswith("interrupted: saved"))
    words = shlex.split(line.split("resume with: ", 1)[1])
    assert words[1:5] == ["-m", "megatron_ppo", "train", "--nproc=2"], line
    assert os.path.samefile(shutil.which(words[0]) or words[0], sys.executable), "this job's interpreter, found"
    assert named_by_latest(training.folder / "ckpt") is not None
    shown = [notice for notice in LIBRARY_NOTICES if notice in training.output]
    assert not shown, f"the libraries' notices are the debug log's, not the run's: {shown}"


def test_a_killed_peer_is_named_with_its_signal_not_called_a_bug(training: Launch) -> None:
    # once a checkpoint is published (a save is published after the next iteration's guards and its background write:
    # on a loaded machine that may come after step 2's line)
    deadline = time.monotonic() + 300
    while named_by_latest(training.folder / "ckpt") is None:
        assert training.process.poll() is None and time.monotonic() < deadline, training.output[-3000:]
        time.sleep(0.2)
    training.worker(1).send_signal(signal.SIGKILL)  # e.g. the kernel's out-of-memory killer
    assert training.end() == 128 + signal.SIGKILL
    _said_once(training.output, "error: rank 1 died (SIGKILL)")
    assert "this is a bug" not in training.output
    latest = named_by_latest(training.folder / "ckpt")
    assert latest is not None and latest.exists(), "the last complete checkpoint is kept"
