"""Spawned-rank code for the guard tests (a real Megatron optimizer and learning-rate schedule)."""

from __future__ import annotations

from typing import Any

from megatron_ppo.config.schema import GuardsConfig, MegatronConfig, OptimConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.parallel import init_distributed
from megatron_ppo.train.guards import Guards
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from tests.distributed.workers import MODEL


def guards_act(rank: int, world_size: int) -> dict[str, Any]:
    init_distributed(MegatronConfig(), seed=0)
    actor = build_role_model("actor", MODEL, MegatronConfig())
    optim = OptimConfig(lr=1e-3)
    scheduler = build_scheduler(build_optimizer(actor, optim, MegatronConfig()), optim, total_steps=100)
    guards = Guards(GuardsConfig(grad_norm_spike_factor=5.0, grad_norm_window=4, lr_backoff_factor=0.5,
                                 kl_explosion_threshold=1.0, max_consecutive_skips=2))  # fmt: skip
    report: dict[str, Any] = {"events": []}
    for step, norm in enumerate([1.0, 1.2, 0.9, 1.1, 1.0]):
        report["events"] += guards.observe(step, {"actor/grad_norm_max": norm}, {"actor": scheduler}, False)
    report["lr_before_spike"] = scheduler.max_lr
    report["events"] += guards.observe(5, {"actor/grad_norm_max": 50.0}, {"actor": scheduler}, False)
    report["lr_after_spike"] = scheduler.max_lr
    report["rollback_before"] = guards.rollback_requested
    report["events"] += guards.observe(
        6, {"kl/mean": 0.5}, {"actor": scheduler}, False, {"kl_explosion_threshold": 0.4}
    )
    report["rollback_after_stage_override"] = guards.rollback_requested
    guards.observe(7, {}, {"actor": scheduler}, True)
    guards.observe(8, {}, {"actor": scheduler}, True)
    try:
        guards.observe(9, {}, {"actor": scheduler}, True)
        report["too_many_skips"] = None
    except RuntimeError as error:
        report["too_many_skips"] = str(error)
    return report
