"""Preemption: Slurm signals a job before its time limit or a preemption (`#SBATCH --signal=USR1@120`, SIGTERM on
`scancel`). Every rank finishes its current iteration; the ranks agree that one of them was signalled, a
checkpoint is saved, and the process exits with `PREEMPTED_EXIT` so the batch script requeues the job, which then
resumes from that checkpoint with nothing lost."""

from __future__ import annotations

import signal
from types import FrameType

from megatron_ppo.parallel.collectives import any_rank

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
        return any_rank(self.signalled is not None)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
