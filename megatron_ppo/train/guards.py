"""Stability guards: after each iteration they read its metrics and say what the trainer must do.

- Non-finite gradients: the optimizer step is skipped (`optimizer_step`); more than `max_consecutive_skips`
  skipped iterations in a row → `stop`.
- Gradient-norm spike: a role's largest grad norm in an iteration above `grad_norm_spike_factor` × the median of
  the last `grad_norm_window` iterations → `lr_backoff` of that role by `lr_backoff_factor`.
- KL explosion: KL(actor‖ref) per token above `kl_explosion_threshold` → `rollback` to the last good checkpoint
  with the learning rates × `rollback_lr_factor`, at most `max_rollbacks` times.
A stage of the KL schedule may override any threshold (its `guards:` mapping). `Guards.observe` changes nothing
but its own history: the trainer carries out the actions and logs their messages.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any, Literal

from megatron_ppo.config.schema import GuardsConfig


@dataclass(frozen=True)
class GuardAction:
    """One thing a guard asks for. `lr_backoff`: scale `role`'s learning rate by `lr_factor`; `rollback`: restore
    the last good checkpoint and scale every learning rate by `lr_factor`, unless `max_rollbacks` were done
    already; `stop`: end the run with `message`."""

    kind: Literal["lr_backoff", "rollback", "stop"]
    message: str
    role: str | None = None
    lr_factor: float = 1.0
    max_rollbacks: int = 0


class Guards:
    def __init__(self, config: GuardsConfig) -> None:
        self.base = config
        self.grad_norms: dict[str, list[float]] = {"actor": [], "critic": []}
        self.consecutive_skips = 0
        self.rollbacks = 0

    def thresholds(self, overrides: dict[str, float] | None) -> GuardsConfig:
        return dataclasses.replace(self.base, **(overrides or {}))

    def observe(
        self, metrics: dict[str, float], skipped: bool, overrides: dict[str, float] | None = None
    ) -> list[GuardAction]:
        """The actions one iteration's metrics call for, under the base thresholds with `overrides` applied."""
        config = self.thresholds(overrides)
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips > config.max_consecutive_skips:
            return [GuardAction("stop", f"{self.consecutive_skips} iterations in a row had non-finite gradients "
                                        f"(limit guards.max_consecutive_skips={config.max_consecutive_skips}); "
                                        "lower the learning rate or inspect the data")]  # fmt: skip
        actions = []
        for role, history in self.grad_norms.items():
            norm = metrics.get(f"{role}/grad_norm_max", float("nan"))
            if not math.isfinite(norm):
                continue
            if len(history) >= max(2, config.grad_norm_window // 2):
                median = statistics.median(history[-config.grad_norm_window :])
                if norm > config.grad_norm_spike_factor * median:
                    actions.append(GuardAction(
                        "lr_backoff", f"{role} grad norm {norm:.3g} > {config.grad_norm_spike_factor} × median "
                        f"{median:.3g}: learning rate × {config.lr_backoff_factor}", role=role,
                        lr_factor=config.lr_backoff_factor,
                    ))  # fmt: skip
            history.append(norm)
            del history[: -config.grad_norm_window]
        kl = metrics.get("kl/mean", float("nan"))
        if math.isfinite(kl) and kl > config.kl_explosion_threshold:
            actions.append(GuardAction(
                "rollback", f"KL {kl:.3g} > guards.kl_explosion_threshold={config.kl_explosion_threshold}: roll back",
                lr_factor=config.rollback_lr_factor, max_rollbacks=config.max_rollbacks,
            ))  # fmt: skip
        return actions

    def state_dict(self) -> dict[str, Any]:
        return {"grad_norms": {k: list(v) for k, v in self.grad_norms.items()}, "rollbacks": self.rollbacks,
                "consecutive_skips": self.consecutive_skips}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.grad_norms = {k: list(v) for k, v in state["grad_norms"].items()}
        self.rollbacks, self.consecutive_skips = state["rollbacks"], state["consecutive_skips"]


def scale_learning_rate(scheduler: Any, factor: float) -> None:
    """Scale a Megatron `OptimizerParamScheduler`'s peak and floor learning rates from now on."""
    scheduler.max_lr *= factor
    scheduler.min_lr *= factor
    scheduler.step(0)
