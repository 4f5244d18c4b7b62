"""When the run saves, and what each save reports: every `trainer.save_freq` steps (not at the last step, and not
after an evaluation rolled the run back), once at the end (unless `save_freq` is -1: verl's "never", the preemption
and job-budget saves aside), and on demand; which saves are good, and so where a rollback or a stop goes, is the
`CheckpointKeeper`'s (`train/checkpoint_keeper.py`)."""

from __future__ import annotations

from pathlib import Path

from megatron_ppo.checkpoint.async_save import SaveTiming
from megatron_ppo.config.schema import TrainerConfig
from megatron_ppo.train import profiling
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.roles import Roles
from megatron_ppo.train.run_state import RunState


class Saves:
    def __init__(self, trainer: TrainerConfig, roles: Roles, state: RunState, keeper: CheckpointKeeper,
                 logger: MetricsLogger) -> None:  # fmt: skip
        self.save_freq, self.roles, self.state, self.keeper, self.logger = (
            trainer.save_freq,
            roles,
            state,
            keeper,
            logger,
        )

    def save(self, wait: bool = False) -> Path:
        """Checkpoint this step; `wait`: published before this returns (`trainer.async_save` writes in the
        background otherwise)."""
        step, roles = self.state.step, self.roles
        with profiling.phase("save"):
            path, written = self.keeper.save(step, roles.models, roles.optimizers, self.state.state_dict())
        if written:
            how = "writing in the background; " if self.keeper.saves is not None else ""
            self.logger.event(step, "checkpoint", f"saved {path} ({how}good once the next iteration's guards pass)")
        if wait:
            self.keeper.wait()
        return path

    def if_due(self, number: int, total_steps: int) -> None:
        """The periodic save after iteration `number`, unless the run was rolled back since or it is the last."""
        step = self.state.step
        if self.save_freq > 0 and step == number and step % self.save_freq == 0 and step < total_steps:
            self.save()

    def final(self) -> None:
        """The run's last save (`save_freq` ≥ 0), published (or a pending one, such as a best evaluation's)."""
        if self.save_freq >= 0:
            self.save()
        self.keeper.wait()


def report_save(logger: MetricsLogger, timing: SaveTiming) -> None:
    """A published save's cost, at its step: `timing/checkpoint_blocked_s`, how long training stopped for it (for an
    asynchronous save: its start, any wait for its write, and its finalisation), and `timing/checkpoint_write_s`, its
    whole write (wall-clock metrics, under `timing/` with the phases'). The keeper's report (a closure over the
    logger alone: nothing the keeper holds holds it)."""
    blocked = timing.blocked_s + timing.waited_s + timing.finalised_s
    logger.log(timing.step, {"timing/checkpoint_blocked_s": blocked, "timing/checkpoint_write_s": timing.write_s})
    how = "in the background" if timing.asynchronous else "synchronously"
    waited = f", {timing.waited_s:.2f} s of it waiting for the write" if timing.waited_s else ""
    logger.event(timing.step, "checkpoint", f"published {timing.path}: written {how} in {timing.write_s:.2f} s; "
                 f"training blocked {blocked:.2f} s{waited}")  # fmt: skip
