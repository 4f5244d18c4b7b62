"""Preemption: Slurm signals a job before its time limit or a preemption (`#SBATCH --signal=USR1@120`, SIGTERM on
`scancel`). Every rank finishes its current iteration; the ranks agree that one of them was signalled, a
checkpoint is saved, and the process exits with `PREEMPTED_EXIT` so the batch script requeues the job, which then
resumes from that checkpoint with nothing lost."""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "try again later"
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised after the checkpoint of a signalled run is saved; the CLI turns it into `PREEMPTED_EXIT`."""


class PreemptionWatch:
    """Records a preemption signal; `agreed()` is true on every rank once any rank got one."""

    def __init__(self) -> None:
        self.signalled: int | None = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signum

    def agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.signalled is not None else 0.0],
                            device="cuda" if torch.cuda.is_available() else "cpu")  # fmt: skip
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() > 0

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
