"""Spawned-rank code for the guard tests (a real Megatron optimizer and learning-rate schedule)."""

from __future__ import annotations

from typing import Any

from megatron_ppo.config.schema import GuardsConfig, MegatronConfig, OptimConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.parallel import init_distributed
from megatron_ppo.train.guards import Guards, scale_learning_rate
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from tests.distributed.workers import MODEL


def learning_rates(scheduler: Any) -> list[float]:
    """The rates Megatron's optimizer will apply: each parameter group's, as the schedule last set them."""
    return [group["lr"] for group in scheduler.optimizer.param_groups]


def guards_act(rank: int, world_size: int) -> dict[str, Any]:
    init_distributed(MegatronConfig(), seed=0)
    actor = build_role_model("actor", MODEL, MegatronConfig())
    optim = OptimConfig(lr=1e-3)
    scheduler = build_scheduler(build_optimizer(actor, optim, MegatronConfig()), optim, total_steps=100)
    guards = Guards(GuardsConfig(grad_norm_spike_factor=5.0, grad_norm_window=4, lr_backoff_factor=0.5,
                                 kl_explosion_threshold=1.0, max_consecutive_skips=2, watch=[]))  # fmt: skip
    report: dict[str, Any] = {"events": [], "kinds": []}

    def observe(metrics: dict[str, float], skipped: bool, overrides: dict[str, float] | None = None) -> list:
        actions = guards.observe(metrics, skipped, overrides)
        for action in actions:
            if action.kind == "lr_backoff":
                scale_learning_rate(scheduler, action.factor)
        report["events"] += [action.message for action in actions]
        return actions

    for norm in [1.0, 1.2, 0.9, 1.1, 1.0]:
        observe({"actor/grad_norm_max": norm}, False)
    report["lr_before_spike"] = learning_rates(scheduler)
    spike = observe({"actor/grad_norm_max": 50.0}, False)
    report["lr_after_spike"] = learning_rates(scheduler)
    report["rollback_before"] = any(action.kind == "rollback" for action in spike)
    explosion = observe({"kl/mean": 0.5}, False, {"kl_explosion_threshold": 0.4, "rollback_lr_factor": 0.25})
    report["rollback_after_stage_override"] = [(a.kind, a.factor) for a in explosion] == [("rollback", 0.25)]
    observe({}, True)
    observe({}, True)
    stop = observe({}, True)
    report["too_many_skips"] = stop[0].message if [a.kind for a in stop] == ["stop"] else None
    return report
