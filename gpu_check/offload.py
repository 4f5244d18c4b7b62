"""Part (d) of the GPU check: the 1.5B-shaped PPO iteration of part (b) with host offload off and on (every role's
weights, gradients and optimizer states that a phase does not need wait in pinned host memory): peak GPU memory
beside the planner's peak for each, the bytes each phase keeps resident, and what the transfers cost in time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_check.plan import (
    GIB,
    Plan,
    backoff_record,
    device_memory,
    ppo_config,
    reset_peak_memory,
    synthetic_rows,
    timed,
)
from gpu_check.sizing import START_S, Sized, build_s, iteration_flops, largest_fitting, shrinking

ITERATIONS = 2  # per trainer: the warm-up and the measured one


def size(plan: Plan) -> Sized:
    """(d) on `plan.card`: the largest shape of (b)'s first length whose iteration with offload off fits (offload on
    plans less); two trainers of it, each moving every role's state through host memory twice an iteration when on."""
    from megatron_ppo.planner import plan as planner

    def cost(shape) -> Sized:
        config = ppo_config(plan, shape)
        states = sum(r.weights_gib + r.grads_gib + r.optimizer_gib for r in planner.plan(config).roles.values())
        moved_gb = ITERATIONS * 2 * states * GIB / 1e9
        return Sized(shape, 0.0, True, flops=2 * ITERATIONS * iteration_flops(config), transfer_gb=moved_gb,
                     fixed_s=START_S + 2 * build_s(config))  # fmt: skip

    return largest_fitting(plan.card, shrinking(plan.base_shape(plan.seq_lengths[0])),
                           lambda shape: planner.plan(ppo_config(plan, shape)).peak_gib, cost)  # fmt: skip


def _offloaded(config):
    """`config` with all three switches on for actor and critic and the reference's weights offloaded."""
    from megatron_ppo.config.frozen import with_changes
    from megatron_ppo.config.schema import ROLES, TRAINED_ROLES
    from megatron_ppo.config.validate import validate

    config = with_changes(config, {
        f"{role}.megatron.{switch}": switch == "param_offload" or role in TRAINED_ROLES
        for role in ROLES for switch in ("param_offload", "grad_offload", "optimizer_offload")
    })  # fmt: skip
    problems = validate(config)
    if problems:
        raise RuntimeError(f"the offload check's config is invalid: {problems}")
    return config


def _measure(plan: Plan, config, rows: list) -> dict[str, Any]:
    """Two iterations (the first warms kernels and creates the optimizer states); peak memory of the second, the
    bytes each phase keeps resident (counted as the offload enters each phase), the planner's figures."""
    from megatron_ppo.planner import plan as planner
    from megatron_ppo.train.ppo import PPOTrainer

    trainer = PPOTrainer(config, rows, pad_id=0)
    resident: dict[str, float] = {}
    enter = trainer.offload.enter

    def enter_and_count(phase: str) -> dict[str, dict[str, int]]:
        placed = enter(phase)
        resident[phase] = sum(sum(kinds.values()) for kinds in placed.values()) / GIB
        return placed

    trainer.offload.enter = enter_and_count  # an instance attribute, deleted below: no cycle outlives the run
    try:
        timed(trainer.iteration)
        reset_peak_memory()
        seconds = timed(trainer.iteration)
        memory = device_memory(plan)
        backoff = backoff_record(trainer)
    finally:
        del trainer.offload.enter
        trainer.close()
    result = planner.plan(config)
    out = {"iteration_s": seconds, "resident_gib": resident, "planned_peak_gib": result.peak_gib,
           "planned_phases_gib": result.phases_gib, "oom_backoff": backoff, **memory}  # fmt: skip
    if memory:
        out["planned_over_measured"] = result.peak_gib / out["measured_peak_gib"]
    return out


def check_offload(plan, work: Path) -> dict[str, Any]:
    """(d): the first sequence length of (b), offload off then on."""
    sized = size(plan)
    shape = sized.shape
    rows = synthetic_rows(plan, shape, seed=shape.seq)
    off = _measure(plan, ppo_config(plan, shape, work / "offload_off"), rows)
    on = _measure(plan, _offloaded(ppo_config(plan, shape, work / "offload_on")), rows)
    backed_off = off["oom_backoff"]["retries"] or on["oom_backoff"]["retries"]
    return {"seq": shape.seq, "rows": shape.rows, "shape": shape.describe(), "sized": sized.describe(), "off": off,
            "on": on, "ok": not backed_off}  # fmt: skip


def table_lines(d: dict[str, Any]) -> list[str]:
    if "off" not in d:
        return [f"(d) host offload                    FAILED {d.get('error', '')[:300]}"]
    lines = [f"(d) host offload, {d['rows']} rows × {d['seq']}   peak GiB  planned GiB  iter s  resident GiB by phase"]
    for name in ("off", "on"):
        run = d[name]
        phases = ", ".join(f"{phase} {gib:.1f}" for phase, gib in run["resident_gib"].items())
        backoff = run["oom_backoff"]
        after = f"  FAILED: measured after {backoff['retries']} out-of-memory back-off(s)" if backoff["retries"] else ""
        lines.append(f"    offload {name:<26}{run.get('measured_peak_gib', float('nan')):8.1f} "
                     f"{run['planned_peak_gib']:12.1f} {run['iteration_s']:7.2f}  {phases}{after}")  # fmt: skip
    lines.append(f"      ran {d['shape']} (sized to the card: {d['sized']})")
    return lines
