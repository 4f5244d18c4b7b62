"""A stop signal (Slurm's SIGTERM or SIGUSR1) that arrives while `train` is still starting — importing torch and
Megatron-Core takes seconds on a loaded node — is not lost to the signal's default action (the process killed: no
line, no requeue marker, the launcher's 143).

The package's `__init__` calls `hold` first thing when the process is the `train` command (`python -m megatron_ppo
train …` or the `megatron-ppo` script). Until the command installs its own handlers:
- a worker (every `train` process but `train --nproc`'s launcher) records the signal; the trainer's preemption watch
  answers it as soon as it is installed (`train/preemption.py`: a stop before training — the marker, exit 75);
- the launcher of `train --nproc`, which has started nothing yet, ends at once: the marker, one line, exit 75. Once
  its workers run, torch's elastic agent holds the signals and forwards them.
Standard library only: this runs before anything else of the package is imported.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later"
MARKER_ENV = "MEGATRON_PPO_PREEMPTED_MARKER"  # the file the batch script requeues on (`slurm/ppo.sbatch`)
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
OUTCOME_DIR = "MEGATRON_PPO_OUTCOME_DIR"  # set by `train --nproc`'s launcher for its workers (`launcher.py`)


def started_by_plain_torchrun() -> bool:
    """Started by `torchrun` itself, not by `train --nproc` (whose workers tell it their outcome)."""
    return "TORCHELASTIC_RUN_ID" in os.environ and OUTCOME_DIR not in os.environ


def stopped_by_plain_torchrun() -> bool:
    """Whether a stop signal before training most likely came from plain `torchrun` ending the others because one
    rank failed (`started_by_plain_torchrun`, and no requeue marker to write: no Slurm job's) — not a preemption."""
    return started_by_plain_torchrun() and MARKER_ENV not in os.environ


_received: list[int] = []


def is_training(argv: Sequence[str]) -> bool:
    """Whether `argv` (as `sys.argv` is while the package is imported) starts the `train` command."""
    program = Path(argv[0]).name if argv else ""
    return (program == "-m" or program == "megatron-ppo") and argv[1:2] == ["train"]


def hold(argv: Sequence[str]) -> None:
    """Install the early handlers for the `train` command (module docstring); nothing for any other process."""
    if not is_training(argv):
        return
    launcher = any(a == "--nproc" or a.startswith("--nproc=") for a in argv[2:])
    for number in SIGNALS:
        signal.signal(number, _end_now if launcher else _record)


def received() -> int | None:
    """The first stop signal recorded before the command's own handlers, if any."""
    return _received[0] if _received else None


def _record(number: int, frame: FrameType | None) -> None:
    _received.append(number)


def _end_now(number: int, frame: FrameType | None) -> None:
    write_marker()
    print(f"stopped early by {signal.Signals(number).name} before training: nothing started yet; exiting with "
          f"{PREEMPTED_EXIT}, requeued unless it was cancelled", file=sys.stderr, flush=True)  # fmt: skip
    os._exit(PREEMPTED_EXIT)


def write_marker() -> None:
    """Write `$MEGATRON_PPO_PREEMPTED_MARKER` (when set) for the batch script."""
    marker = os.environ.get(MARKER_ENV)
    if marker:
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).write_text("preempted: requeue me\n")
