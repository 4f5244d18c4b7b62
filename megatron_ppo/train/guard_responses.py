"""What the trainer does when a guard fires (`guards.Guards` decides; this carries it out): each action logged as a
`guard/<guard>` event and scalar (the value that fired it) at the step it fired — also when an earlier action
rolled the run back — then handled by its kind (`GUARD_ACTIONS`): a warning is its log line; a learning-rate
back-off scales the rates (never below `guards.min_lr_fraction` of the configured ones); a KL bump scales β; a
rollback restores a checkpoint with lower rates; a stop ends the run with one message."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper
from megatron_ppo.train.guards import (
    ActionKind,
    GuardAction,
    Guards,
    GuardStopped,
    applied_factor,
    scale_learning_rate,
)
from megatron_ppo.train.kl_coefficients import KLCoefficients
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.roles import Roles
from megatron_ppo.train.run_state import RunState


class GuardResponses:
    def __init__(self, config: PPOConfig, roles: Roles, state: RunState, guards: Guards, kl: KLCoefficients,
                 keeper: CheckpointKeeper, logger: MetricsLogger) -> None:  # fmt: skip
        self.config, self.roles, self.state, self.guards = config, roles, state, guards
        self.kl, self.keeper, self.logger = kl, keeper, logger

    def respond(self, actions: list[GuardAction]) -> None:
        """Carry out `actions` (module docstring)."""
        fired_at = self.state.step
        for action in actions:
            self.logger.event(fired_at, f"guard/{action.guard}", action.message)
            self.logger.log(fired_at, {f"guard/{action.guard}": action.value if math.isfinite(action.value) else 1.0})
            GUARD_ACTIONS[action.kind](self, action, fired_at)

    def warn(self, action: GuardAction, fired_at: int) -> None:
        """A warning is its log line alone."""

    def back_off(self, action: GuardAction, fired_at: int) -> None:
        for role in [action.role] if action.role else list(self.roles.schedulers):
            self.scale_learning_rate(role, action.factor)

    def bump_kl(self, action: GuardAction, fired_at: int) -> None:
        self.kl.scale(action.factor)

    def stop(self, action: GuardAction, fired_at: int) -> None:
        """End the run on a guard's `stop`, the good checkpoint named in `latest`; `GuardStopped` carries the one
        message the command line prints."""
        message = f"guard/{action.guard} stopped the run: {action.message}; {self.keeper.leave_for_stop()}"
        self.logger.event(self.state.step, "stopped", message)
        raise GuardStopped(message)

    def scale_learning_rate(self, role: str, factor: float) -> None:
        """`role`'s learning rate × `factor`, never below `guards.min_lr_fraction` × its configured rate."""
        fraction = self.config.guards.min_lr_fraction
        applied = scale_learning_rate(
            self.roles.schedulers[role], factor, fraction * getattr(self.config, role).optim.lr
        )
        if applied != factor:
            self.logger.event(self.state.step, "guard/lr_floor", f"{role} learning rate held at "
                              f"guards.min_lr_fraction={fraction} of its configured rate")  # fmt: skip

    def roll_back(self, action: GuardAction, fired_at: int) -> None:
        """Restore a checkpoint — the good one, or the best evaluation's (`CheckpointKeeper.rollback_target`) — with
        lower learning rates. The guards keep their own counters, the out-of-memory back-off its smaller
        micro-batches and the schedules the learning-rate back-off the run had reached (not the checkpoint's), which
        `factor` lowers again: each rollback into one checkpoint replays it with lower rates than the last. A
        rollback that cannot lower them (each at `guards.min_lr_fraction` of its configured rate) would replay the
        same steps with the same settings, so it stops the run instead, as `guards.max_rollbacks` reached does (a
        guard stop: one line, the good checkpoint named in `latest`). An evaluation saved in a checkpoint passed
        over is forgotten with it (its best is the loaded one's)."""
        guards, target, roles = self.guards, self.keeper.rollback_target(action.target), self.roles
        if target.path is None:
            self.logger.event(fired_at, "guard/rollback", "rollback not possible: no good checkpoint to return to "
                              "yet; continuing")  # fmt: skip
            return
        reached = {role: scheduler.backoff for role, scheduler in roles.schedulers.items()}
        if guards.rollbacks >= action.max_rollbacks:
            self.stop(replace(action, message=f"{action.message}; guards.max_rollbacks={action.max_rollbacks} "
                              "reached"), fired_at)  # fmt: skip
        if not any(self.lowered_factor(role, action.factor, reached[role]) < 1.0 for role in roles.schedulers):
            self.stop(replace(action, message=f"{action.message}; every learning rate is at guards.min_lr_fraction="
                              f"{self.config.guards.min_lr_fraction}: a rollback would replay the same steps with "
                              "the same settings"), fired_at)  # fmt: skip
        state, best_forgotten = self.keeper.roll_back_to(target.path, roles.models, roles.optimizers)
        self.state.load_state_dict(state, keep=("guards", "memory"))
        if best_forgotten:
            guards.best_eval = state["guards"]["best_eval"]
            guards.evals_since_best = state["guards"]["evals_since_best"]
        guards.rollbacks += 1
        for role, scheduler in roles.schedulers.items():
            scheduler.backoff = reached[role]  # the back-offs compound across rollbacks
            self.scale_learning_rate(role, action.factor)
        rates = ", ".join(f"{role} × {scheduler.backoff:.4g}" for role, scheduler in roles.schedulers.items())
        self.logger.event(fired_at, "guard/rollback", f"rolled back to {target.path}, learning rates × "
                          f"{action.factor} ({rates} of the schedule's); the run continues from step "
                          f"{self.state.step}. Why this checkpoint: {target.why}")  # fmt: skip
        self.logger.log(fired_at, {"guard/rollback": float(guards.rollbacks)})

    def lowered_factor(self, role: str, factor: float, backoff: float) -> float:
        """The factor `scale_learning_rate` would apply to `role`'s rate at `backoff`: `factor`, or less of a cut
        where `guards.min_lr_fraction` holds it (1.0: no cut at all)."""
        floor = self.config.guards.min_lr_fraction * getattr(self.config, role).optim.lr
        return applied_factor(backoff * self.roles.schedulers[role].max_lr, factor, floor)


# What the trainer does for each kind of guard action (`guards.ActionKind`), besides logging it.
GUARD_ACTIONS: dict[ActionKind, Callable[[GuardResponses, GuardAction, int], None]] = {
    "warn": GuardResponses.warn,
    "lr_backoff": GuardResponses.back_off,
    "kl_bump": GuardResponses.bump_kl,
    "rollback": GuardResponses.roll_back,
    "stop": GuardResponses.stop,
}
