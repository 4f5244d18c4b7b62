"""Stability guards: after each iteration (and each evaluation) they read the metrics and say what the trainer must do.

Per iteration (`Guards.observe`):
- Non-finite gradients: the optimizer step is skipped (`optimizer_step`); more than `max_consecutive_skips`
  skipped iterations in a row → `stop`.
- Gradient norm, per role (measured before clipping): above the absolute `grad_norm_threshold`, or above
  `grad_norm_spike_factor` × the median of the last `grad_norm_window` iterations → `lr_backoff` of that role by
  `lr_backoff_factor` (one back-off per role and iteration).
- KL explosion: the KL of this iteration's update (`UPDATE_KL`, below) above `kl_explosion_threshold`, or not finite
  → `rollback` to the last good checkpoint with the learning rates × `rollback_lr_factor`, at most `max_rollbacks`
  times (all rollbacks count together).
- Loss explosion: a non-finite loss, or |loss| above `loss_explosion_factor` × its running median and above the
  absolute `loss_explosion_floor` (actor: the policy-gradient loss, critic: the value loss) → `rollback`, as for the
  KL. The floor: a policy loss of whitened advantages is ≈ 0 ± 0.01–0.1, so ten times its median is noise.
- KL bump: the update's KL above `kl_bump_threshold` → `kl_bump`: every active β × `kl_bump_factor`, within the
  controllers' clamps.
- Watch: each `watch` rule logs an event when its metric rises above its `max` (once per crossing) and does its
  action: `warn`, `lr_backoff` (every role, `lr_backoff_factor`) or `kl_bump`.
Per evaluation (`Guards.observe_evaluation`):
- Evaluation drop: `eval/reward_mean` below best − `eval_drop_fraction`·|best| → `rollback` to the checkpoint of the
  best evaluation.
- Plateau (off unless `plateau_evaluations` > 0): no new best in that many evaluations → `lr_backoff` of every role
  by `plateau_lr_factor`.
A stage of the KL schedule may override any numeric threshold (its `guards:` mapping). The guards change nothing
but their own history: the trainer carries out the actions and logs their messages; a `stop` ends the run with
`GuardStopped` (exit status `GUARD_STOP_EXIT`).

The KL guards read the policy this iteration's update made, not the one it started from: `kl/mean` is measured in
the experience, before the update, so a bad update would show there only one iteration later — after the save that
closed it. `actor/ref_kl` is the actor update's own estimate, KL(π_θ‖π_ref) per response token (the estimator of
`kl/mean`) under the weights each mini-batch is trained from, averaged over the update's mini-batches; it sees
every optimizer step of the iteration but its last, which the next iteration's guards see before that save counts
as good (`PPOTrainer`, "good checkpoints"). Without an actor update (critic warm-up) the policy did not move and
`kl/mean` is its KL.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Literal

from megatron_ppo.config.schema import GuardsConfig

ROLE_LOSSES = {"actor": "actor/pg_loss", "critic": "critic/vf_loss"}
UPDATE_KL = "actor/ref_kl"  # the actor update's KL to the reference (train/update.py, `actor_loss`)
EXPERIENCE_KL = "kl/mean"  # the KL of the policy before the update (train/experience.py): the controller's input
PROBE_PREFIX = "kl/probe_"  # the KL probe's metrics (train/kl_probe.py): after the update, on fixed rows
PROBE_KL = PROBE_PREFIX + "mean"  # what `feedback: probe` controls, and the KL its tracking is judged on
GUARD_STOP_EXIT = 3  # a guard's stop: not 0 (a chained job must not start), not 75 (`Preempted`: no requeue)
ActionKind = Literal["lr_backoff", "rollback", "kl_bump", "warn", "stop"]


@dataclass(frozen=True)
class GuardAction:
    """One thing a guard asks for, named by the guard that fired (`guard`, e.g. "grad_norm", "kl_explosion").

    `lr_backoff`: scale `role`'s learning rate (every role's when None) by `factor`; `rollback`: restore a checkpoint
    (`target`: "latest" good one, or "best_eval") and scale every learning rate by `factor`, unless `max_rollbacks`
    were done already; `kl_bump`: scale every active KL β by `factor`; `warn`: log only; `stop`: end the run."""

    kind: ActionKind
    guard: str
    message: str
    role: str | None = None
    factor: float = 1.0
    max_rollbacks: int = 0
    target: Literal["latest", "best_eval"] = "latest"
    value: float = math.nan  # the measured value that fired the guard (logged as `guard/<guard>`)


class GuardStopped(Exception):
    """A guard's `stop`, once carried out: its message names the guard, the value, the threshold and the checkpoint
    left; the command line prints it and exits `exit_status`."""

    exit_status = GUARD_STOP_EXIT


def guarded_kl(metrics: dict[str, float]) -> float | None:
    """The KL the KL guards read: the update's `UPDATE_KL` when the actor was updated, else `EXPERIENCE_KL`; None
    without a KL term."""
    return metrics.get(UPDATE_KL, metrics.get(EXPERIENCE_KL))


class Guards:
    def __init__(self, config: GuardsConfig) -> None:
        self.base = config
        self.grad_norms: dict[str, list[float]] = {"actor": [], "critic": []}
        self.losses: dict[str, list[float]] = {"actor": [], "critic": []}
        self.consecutive_skips = 0
        self.rollbacks = 0
        self.watching: list[str] = []  # watched metrics currently above their max
        self.best_eval: float | None = None
        self.evals_since_best = 0

    def thresholds(self, overrides: dict[str, float] | None) -> GuardsConfig:
        return dataclasses.replace(self.base, **(overrides or {}))

    def observe(
        self, metrics: dict[str, float], skipped: bool, overrides: dict[str, float] | None = None
    ) -> list[GuardAction]:
        """The actions one iteration's metrics call for, under the base thresholds with `overrides` applied."""
        config = self.thresholds(overrides)
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips > config.max_consecutive_skips:
            return [GuardAction("stop", "nonfinite", f"{self.consecutive_skips} iterations in a row had non-finite "
                                f"gradients (limit guards.max_consecutive_skips={config.max_consecutive_skips}); "
                                "lower the learning rate or inspect the data")]  # fmt: skip
        actions = []
        if skipped:
            message = f"non-finite gradient: the optimizer step was skipped ({self.consecutive_skips} in a row)"
            actions.append(GuardAction("warn", "nonfinite", message, value=self.consecutive_skips))
        actions += [action for role in self.grad_norms if (action := self._grad_norm(config, role, metrics))]
        rollback = self._loss_explosion(config, metrics, skipped) or self._kl_explosion(config, metrics)
        if rollback is not None:
            actions.append(rollback)
        kl = guarded_kl(metrics)
        bump = config.kl_bump_threshold
        if bump is not None and kl is not None and math.isfinite(kl) and kl > bump:
            actions.append(GuardAction("kl_bump", "kl_bump", f"KL {kl:.3g} > guards.kl_bump_threshold="
                                       f"{config.kl_bump_threshold}: every KL β × {config.kl_bump_factor}",
                                       factor=config.kl_bump_factor, value=kl))  # fmt: skip
        return actions + self._watch(config, metrics)

    def _grad_norm(self, config: GuardsConfig, role: str, metrics: dict[str, float]) -> GuardAction | None:
        norm = metrics.get(f"{role}/grad_norm_max", math.nan)
        if not math.isfinite(norm):
            return None
        history, action = self.grad_norms[role], None
        if config.grad_norm_threshold is not None and norm > config.grad_norm_threshold:
            reason = f"> guards.grad_norm_threshold={config.grad_norm_threshold}"
        elif len(history) >= max(2, config.grad_norm_window // 2) and norm > config.grad_norm_spike_factor * (
            median := statistics.median(history[-config.grad_norm_window :])
        ):
            reason = f"> {config.grad_norm_spike_factor} × median {median:.3g} (guards.grad_norm_spike_factor)"
        else:
            reason = None
        if reason is not None:
            action = GuardAction("lr_backoff", "grad_norm", f"{role} grad norm {norm:.3g} {reason}: learning rate × "
                                 f"{config.lr_backoff_factor}", role=role, factor=config.lr_backoff_factor,
                                 value=norm)  # fmt: skip
        history.append(norm)
        del history[: -config.grad_norm_window]
        return action

    def _loss_explosion(self, config: GuardsConfig, metrics: dict[str, float], skipped: bool) -> GuardAction | None:
        fired = None
        for role, key in ROLE_LOSSES.items():
            if key not in metrics:
                continue
            loss, history = abs(metrics[key]), self.losses[role]
            if not math.isfinite(loss):
                fired = fired or (role, loss, f"{key} is {metrics[key]}" + (" after a skipped step" if skipped else ""))
                continue
            if config.loss_explosion_factor is not None and len(history) >= max(2, config.grad_norm_window // 2):
                median = statistics.median(history[-config.grad_norm_window :])
                if loss > max(config.loss_explosion_factor * median, config.loss_explosion_floor):
                    fired = fired or (role, loss, f"|{key}| {loss:.3g} > guards.loss_explosion_factor="
                                      f"{config.loss_explosion_factor} × median {median:.3g} and > "
                                      f"guards.loss_explosion_floor={config.loss_explosion_floor}")  # fmt: skip
            history.append(loss)
            del history[: -config.grad_norm_window]
        if fired is None:
            return None
        return GuardAction("rollback", "loss_explosion", f"{fired[2]}: roll back", factor=config.rollback_lr_factor,
                           max_rollbacks=config.max_rollbacks, value=fired[1])  # fmt: skip

    def _kl_explosion(self, config: GuardsConfig, metrics: dict[str, float]) -> GuardAction | None:
        kl = guarded_kl(metrics)
        if kl is None or kl <= config.kl_explosion_threshold:  # (a NaN KL is no better: non-finite weights)
            return None
        return GuardAction("rollback", "kl_explosion", f"KL {kl:.3g} > guards.kl_explosion_threshold="
                           f"{config.kl_explosion_threshold}: roll back", factor=config.rollback_lr_factor,
                           max_rollbacks=config.max_rollbacks, value=kl)  # fmt: skip

    def _watch(self, config: GuardsConfig, metrics: dict[str, float]) -> list[GuardAction]:
        actions = []
        for rule in config.watch:
            value = metrics.get(rule.metric, math.nan)
            if not math.isfinite(value):
                continue
            if value <= rule.max:
                if rule.metric in self.watching:
                    self.watching.remove(rule.metric)
                continue
            if rule.metric in self.watching:
                continue  # still above: acted on when it crossed
            self.watching.append(rule.metric)
            factor = {"warn": 1.0, "lr_backoff": config.lr_backoff_factor, "kl_bump": config.kl_bump_factor}
            then = {"warn": "watch it", "lr_backoff": f"every learning rate × {factor['lr_backoff']}",
                    "kl_bump": f"every KL β × {factor['kl_bump']}"}[rule.action]  # fmt: skip
            actions.append(GuardAction(rule.action, "watch", f"{rule.metric} {value:.3g} > watched max {rule.max}: "
                                       f"{then}", factor=factor[rule.action], value=value))  # fmt: skip
        return actions

    def observe_evaluation(self, reward: float) -> list[GuardAction]:
        """The actions an evaluation's mean reward calls for; remembers the best one."""
        config = self.base
        if self.best_eval is None or reward > self.best_eval:
            self.best_eval, self.evals_since_best = reward, 0
            return []
        self.evals_since_best += 1
        floor = self.best_eval - (config.eval_drop_fraction or 0.0) * abs(self.best_eval)
        if config.eval_drop_fraction is not None and reward < floor:
            return [GuardAction("rollback", "eval_drop", f"eval/reward_mean {reward:.4g} < best {self.best_eval:.4g}"
                                f" − guards.eval_drop_fraction={config.eval_drop_fraction}·|best|: roll back to the "
                                "best evaluation's checkpoint", factor=config.rollback_lr_factor,
                                max_rollbacks=config.max_rollbacks, target="best_eval", value=reward)]  # fmt: skip
        if config.plateau_evaluations and self.evals_since_best >= config.plateau_evaluations:
            self.evals_since_best = 0
            return [GuardAction("lr_backoff", "plateau", f"no better evaluation than {self.best_eval:.4g} in "
                                f"{config.plateau_evaluations} evaluations (guards.plateau_evaluations): every "
                                f"learning rate × {config.plateau_lr_factor}", factor=config.plateau_lr_factor,
                                value=reward)]  # fmt: skip
        return []

    def state_dict(self) -> dict[str, Any]:
        return {"grad_norms": {k: list(v) for k, v in self.grad_norms.items()},
                "losses": {k: list(v) for k, v in self.losses.items()}, "rollbacks": self.rollbacks,
                "consecutive_skips": self.consecutive_skips, "watching": list(self.watching),
                "best_eval": self.best_eval, "evals_since_best": self.evals_since_best}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grad_norms = {k: list(v) for k, v in state["grad_norms"].items()}
        self.losses = {k: list(v) for k, v in state["losses"].items()}
        self.rollbacks, self.consecutive_skips = state["rollbacks"], state["consecutive_skips"]
        self.watching = list(state["watching"])
        self.best_eval, self.evals_since_best = state["best_eval"], state["evals_since_best"]


def scale_learning_rate(scheduler: Any, factor: float, floor: float = 0.0) -> float:
    """Scale a `BackedOffScheduler`'s learning rates from now on by a back-off `factor` ≤ 1 (its `backoff`), never
    taking the peak, backoff · max_lr, below `floor` (nor raising it); returns the factor applied. The optimizer's
    groups take the new rate at once."""
    applied = applied_factor(scheduler.backoff * scheduler.max_lr, factor, floor)
    scheduler.backoff *= applied
    scheduler.step(0)
    return applied


def applied_factor(peak: float, factor: float, floor: float) -> float:
    """The back-off factor that takes a peak rate `peak` down by `factor` but not below `floor` (nor up): 1.0 when
    the peak is at the floor already."""
    return min(1.0, max(factor, floor / peak if peak > 0 else 0.0))
