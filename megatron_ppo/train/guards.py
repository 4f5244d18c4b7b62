"""Stability guards that act between iterations; every action is returned as a message for the logs.

- Non-finite gradients: the optimizer step is skipped (`optimizer_step`); more than `max_consecutive_skips`
  skipped iterations in a row stop training with an error.
- Gradient-norm spike: a role's largest grad norm in an iteration above `grad_norm_spike_factor` × the median of
  the last `grad_norm_window` iterations scales that role's learning-rate schedule by `lr_backoff_factor`.
- KL explosion: KL(actor‖ref) per token above `kl_explosion_threshold` asks the trainer to roll back to the last
  good checkpoint with the learning rates scaled by `rollback_lr_factor` (at most `max_rollbacks` times).
A stage of the KL schedule may override any threshold (its `guards:` mapping).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from megatron_ppo.config.schema import GuardsConfig


class Guards:
    def __init__(self, config: GuardsConfig) -> None:
        self.base = config
        self.grad_norms: dict[str, list[float]] = {"actor": [], "critic": []}
        self.consecutive_skips = 0
        self.rollbacks = 0
        self.rollback_requested = False

    def thresholds(self, overrides: dict[str, float] | None) -> GuardsConfig:
        return dataclasses.replace(self.base, **(overrides or {}))

    def observe(self, step: int, metrics: dict[str, float], schedulers: dict[str, Any],
                skipped: bool, overrides: dict[str, float] | None = None) -> list[str]:  # fmt: skip
        """Check one iteration's metrics; adjust schedules in place; return what was done."""
        config = self.thresholds(overrides)
        events = []
        self.consecutive_skips = self.consecutive_skips + 1 if skipped else 0
        if self.consecutive_skips > config.max_consecutive_skips:
            raise RuntimeError(
                f"{self.consecutive_skips} iterations in a row had non-finite gradients (limit guards."
                f"max_consecutive_skips={config.max_consecutive_skips}); lower the learning rate or inspect the data"
            )
        for role, history in self.grad_norms.items():
            norm = metrics.get(f"{role}/grad_norm_max", float("nan"))
            if not math.isfinite(norm):
                continue
            if len(history) >= max(2, config.grad_norm_window // 2):
                median = statistics.median(history[-config.grad_norm_window :])
                if norm > config.grad_norm_spike_factor * median:
                    scale_learning_rate(schedulers[role], config.lr_backoff_factor)
                    events.append(
                        f"{role} grad norm {norm:.3g} > {config.grad_norm_spike_factor} × median {median:.3g}: "
                        f"learning rate × {config.lr_backoff_factor}"
                    )
            history.append(norm)
            del history[: -config.grad_norm_window]
        kl = metrics.get("kl/mean", float("nan"))
        if math.isfinite(kl) and kl > config.kl_explosion_threshold:
            self.rollback_requested = True
            events.append(f"KL {kl:.3g} > guards.kl_explosion_threshold={config.kl_explosion_threshold}: roll back")
        return events

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
