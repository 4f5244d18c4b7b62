"""Running the real CLI (`torchrun -m megatron_ppo train recipes/tiny-cpu.yaml ...`, shortened as
`bench.tiny.SHORT`) in tests: to completion, killed after a checkpoint, or signalled after a step."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from bench.tiny import RECIPE, REPO, SHORT


def command(nproc: int, overrides: list[str], recipe: Path = RECIPE) -> list[str]:
    torchrun = Path(sys.executable).with_name("torchrun")
    return [str(torchrun), f"--nproc_per_node={nproc}", "--standalone", "-m", "megatron_ppo", "train",
            str(recipe), *SHORT, f"cluster.gpus_per_node={nproc}", *overrides]  # fmt: skip


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(nproc: int, overrides: list[str], log: Path, timeout_s: float = 900, recipe: Path = RECIPE) -> None:
    """Run `recipe` (shortened) to completion; on failure, raise with the end of the log."""
    with log.open("w") as out:
        result = subprocess.run(command(nproc, overrides, recipe), cwd=REPO, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT, timeout=timeout_s, check=False)  # fmt: skip
    if result.returncode != 0:
        raise AssertionError(f"training exited {result.returncode}; log tail:\n{log.read_text()[-4000:]}")


def _named_step(latest: Path) -> int | None:
    """The step of the checkpoint `latest` names, None before the first (or while it is being replaced)."""
    try:
        return int(latest.read_text().strip().removeprefix("step_"))
    except (FileNotFoundError, ValueError):
        return None


def run_and_kill_after_checkpoint(
    nproc: int, overrides: list[str], checkpoint_root: Path, step: int, log: Path, timeout_s: float = 900
) -> int:
    """Start a run and SIGKILL it, workers included, as soon as `latest` names `step_<step>` or a later checkpoint;
    the step it named (`step` unless the machine was too loaded to look between two saves: the caller resumes from
    whichever it is, so no wait races the run)."""
    with log.open("w") as out:
        process = subprocess.Popen(command(nproc, overrides), cwd=REPO, env=_env(), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        latest = checkpoint_root / "latest"
        while time.monotonic() < deadline and process.poll() is None:
            named = _named_step(latest)
            if named is not None and named >= step:
                _kill_tree(process.pid)
                process.wait()
                return _named_step(latest) or named  # a save may have been renamed in before the kill landed
            time.sleep(0.05)
        _kill_tree(process.pid)
        process.wait()
        raise AssertionError(
            f"no checkpoint step_{step} or later appeared (exit {process.poll()}); log:\n{log.read_text()[-4000:]}"
        )


def run_and_signal_after_step(
    nproc: int, overrides: list[str], step: int, signum: int, log: Path, timeout_s: float = 900
) -> int:
    """Start a run, send `signum` to its training processes (as Slurm does to its tasks) once `step` has been
    logged, and return the launcher's exit status. Where the signal lands after that depends on the machine's
    load: the caller reads the step the run saved at from `latest`."""
    with log.open("w") as out:
        process = subprocess.Popen(command(nproc, overrides), cwd=REPO, env=_env(), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and process.poll() is None:
            if f"step {step}:" in log.read_text():
                for worker in psutil.Process(process.pid).children(recursive=True):
                    with contextlib.suppress(psutil.NoSuchProcess):
                        worker.send_signal(signum)
                return process.wait(timeout=timeout_s)
            time.sleep(0.1)
        _kill_tree(process.pid)
        process.wait()
        raise AssertionError(f"step {step} never logged (exit {process.poll()}); log:\n{log.read_text()[-4000:]}")


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (torchrun's workers live in process groups of their own)."""
    parent = psutil.Process(pid)
    for process in [*parent.children(recursive=True), parent]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGKILL)
