"""When a run stops before its last step, after an iteration: a preemption signal or a Ctrl-C that every rank has
agreed on (a checkpoint, then `Preempted` — marked for the batch script to requeue — or `Interrupted`), or this
job's share of a chained run spent (`trainer.exit_interval`, `exit_duration_in_mins`: a checkpoint, then
`JobBudgetReached`). The signals are watched for the whole loop (`watching`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from megatron_ppo.config.schema import TrainerConfig
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.preemption import (
    Interrupted,
    JobBudget,
    JobBudgetReached,
    PreemptionWatch,
    mark_preempted,
    watching,
)
from megatron_ppo.train.run_state import RunState
from megatron_ppo.train.saving import Saves


class Stops:
    def __init__(self, trainer: TrainerConfig, saves: Saves, state: RunState, logger: MetricsLogger,
                 total_steps: int) -> None:  # fmt: skip
        self.budget = JobBudget(trainer.exit_interval, trainer.exit_duration_in_mins)
        self.saves, self.state, self.logger, self.total_steps = saves, state, logger, total_steps
        self.watch: PreemptionWatch | None = None

    @contextmanager
    def watching(self) -> Iterator[None]:
        """The training loop, its signals watched (a Ctrl-C inside it is answered after the iteration)."""
        with watching() as watch, watch.in_the_loop():
            self.watch = watch
            try:
                yield
            finally:
                self.watch = None

    def check(self) -> None:
        """After an iteration: save and raise if the run must stop here (module docstring)."""
        step, watch = self.state.step, self.watch
        assert watch is not None, "Stops.check outside Stops.watching"
        if watch.agreed():
            path = self.saves.save(wait=True)
            stop = watch.stop(str(path))
            if isinstance(stop, Interrupted):
                self.logger.event(step, "interrupted", f"Ctrl-C; checkpoint {path}, exiting")
                raise stop
            self.logger.event(step, "preempted", f"signal received; checkpoint {path}, exiting 75 (the batch script "
                                                 "requeues the job unless it was cancelled)")  # fmt: skip
            mark_preempted()
            raise stop
        if step < self.total_steps and (reason := self.budget.reason(step)):
            path = self.saves.save(wait=True)
            self.logger.event(step, "job budget", f"{reason}; checkpoint {path}, the next job resumes")
            raise JobBudgetReached(str(path))
