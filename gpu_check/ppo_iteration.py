"""Part (b) of the GPU check: the Qwen2.5-1.5B-shaped PPO iteration through the trainer's own
`PPOTrainer.iteration()`, packed as every GPU recipe runs, at each of the plan's sequence lengths (one process each):
tokens/s, MFU of the iteration, of each phase (the trainer's own timers) and of its bare passes, computed / real
tokens, peak memory beside the planner's, and at the first length the same batch padded against it.

The bare passes are the iteration's own work with nothing around it: the experience (`forward_passes`, no grad, eval
mode, as the trainer runs it) and one forward-backward of critic and actor over the same micro-batches with the
trainer's losses — no optimizer step, no metrics reduced, no KL control, guards or checkpoint. So iteration / bare
≥ 1 by construction, and its excess is what the iteration adds around the passes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from gpu_check.plan import Plan, backoff_record, device_memory, ppo_config, reset_peak_memory, synthetic_rows, timed
from gpu_check.sizing import START_S, Sized, build_s, iteration_flops, largest_fitting, shrinking

PROFILE_S = 15.0  # the profiler's trace parsed after the profiled iteration
COMPILE_S = 10.0  # the first iteration's kernel choices and torch.compile'd fusions


def iterations_run(plan: Plan, seq: int) -> float:
    """The iterations (b) runs at `seq`: warm-up and timed, and at the first length profiled and twice padded;
    the bare passes about one more."""
    return 6.0 if seq == plan.seq_lengths[0] else 3.0


def size(plan: Plan, seq: int) -> Sized:
    """(b) at `seq` on `plan.card`: the largest shape that fits (`gpu_check.sizing`), its iteration's tokens kept."""

    def config_of(shape):
        return ppo_config(plan, shape, pack_sequences=True)

    def cost(shape) -> Sized:
        config = config_of(shape)
        fixed = START_S + build_s(config) + COMPILE_S + (PROFILE_S if seq == plan.seq_lengths[0] else 0.0)
        return Sized(shape, 0.0, True, flops=iterations_run(plan, seq) * iteration_flops(config), fixed_s=fixed)

    return largest_fitting(plan.card, shrinking(plan.base_shape(seq)), lambda s: planner_peak(config_of(s)), cost)


def planner_peak(config) -> float:
    from megatron_ppo.planner import plan as planner

    return planner.plan(config).peak_gib


def bare_passes(trainer, batch) -> None:
    """The iteration's passes alone (module docstring) on `batch` (on the device)."""
    from megatron_ppo.models import run_micro_batches
    from megatron_ppo.train.batch import replica_micro_batches
    from megatron_ppo.train.experience import compute_advantages, forward_passes
    from megatron_ppo.train.optimizer import zero_grads
    from megatron_ppo.train.update import mini_batch_counts, role_loss

    config = trainer.config
    passes = forward_passes(config, batch, trainer.actor, trainer.ref, trainer.critic)
    experience, _ = compute_advantages(config, batch, passes, None, None)
    for role in ("critic", "actor"):
        model, optimizer = trainer.models[role], trainer.optimizers[role]
        role_config = getattr(config, role)
        _, _, micro = replica_micro_batches(experience, role_config.ppo_micro_batch_size_per_gpu, None,
                                            model.pack_multiple)  # fmt: skip
        zero_grads(model, optimizer)
        loss = role_loss(role, config, model, 0.1, trainer.ref is not None)(mini_batch_counts(experience))
        run_micro_batches(model, micro, loss, forward_only=False)
    for role, model in trainer.models.items():
        zero_grads(model, trainer.optimizers[role])


def profile_iteration(trainer, top: int = 8) -> dict[str, Any]:
    """One more iteration under torch's profiler: the `top` kernels by device time (on the CPU: operators by self
    time) with their share of it, and the device's busy share of the wall time (kernel time over wall time; below 1
    is time the GPU waited for the host)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as profiler:
        wall_s = timed(trainer.iteration)
    events = profiler.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = [e for e in events if getattr(e, key, 0) > 0 and (not cuda or e.device_type.name == "CUDA")]
    busy_us = sum(getattr(e, key) for e in kernels)
    ranked = sorted(kernels, key=lambda e: getattr(e, key), reverse=True)[:top]
    return {
        "wall_s": wall_s, "device_busy_share": busy_us / 1e6 / wall_s if cuda else float("nan"),
        "top": [{"name": e.key[:120], "ms": getattr(e, key) / 1e3, "share": getattr(e, key) / max(busy_us, 1),
                 "calls": e.count} for e in ranked],
    }  # fmt: skip


def check_ppo_iteration(plan: Plan, work: Path, seq: int) -> dict[str, Any]:
    from megatron_ppo.config.gpus import gpu_spec
    from megatron_ppo.models.attention import PACKED_PATHS_RUN
    from megatron_ppo.models.kernels import describe_kernels
    from megatron_ppo.parallel.device import current_device, to_device
    from megatron_ppo.planner import plan as planner
    from megatron_ppo.train.batch import collate
    from megatron_ppo.train.ppo import PPOTrainer
    from megatron_ppo.train.throughput import throughput_metrics

    first = seq == plan.seq_lengths[0]
    sized = size(plan, seq)
    shape = sized.shape
    seq, rows = shape.seq, shape.rows  # shorter rows where the card needs them
    config = ppo_config(plan, shape, work / f"ppo{seq}", pack_sequences=True)
    reset_peak_memory()
    started = time.perf_counter()
    trainer = PPOTrainer(config, synthetic_rows(plan, shape, seed=seq), pad_id=0)
    build_s = time.perf_counter() - started
    models = [model for model in (trainer.actor, trainer.ref, trainer.critic) if model is not None]
    try:
        state = trainer.sampler.state_dict()
        warmup_s = timed(trainer.iteration)  # kernels chosen, allocator warmed, optimizer states created
        trainer.sampler.load_state_dict(state)  # the timed iteration and the bare passes see the warm-up's batch
        metrics: dict[str, float] = {}
        iteration_s = timed(lambda: metrics.update(trainer.iteration()))
        memory = device_memory(plan)
        measured_after = backoff_record(trainer)  # a back-off by now: the figures are a smaller shape's
        profiled = None
        if first:
            trainer.sampler.load_state_dict(state)
            profiled = profile_iteration(trainer)
        packed_passes = sorted(note for model in models for note in model.pass_notes)
        batch = to_device(collate(trainer.rows[:rows], pad_id=0), current_device(), "the bare passes' batch")
        bare_s = timed(lambda: bare_passes(trainer, batch))
        padded_metrics: dict[str, float] = {}
        padded_s = float("nan")
        if first:  # the same batch again padded (warmed first): what packing costs here
            for model in models:
                model.pack_sequences = False
            trainer.sampler.load_state_dict(state)
            trainer.iteration()
            trainer.sampler.load_state_dict(state)
            padded_s = timed(lambda: padded_metrics.update(trainer.iteration()))
        backoff = backoff_record(trainer)
    finally:
        trainer.close()
    roles = ("actor", "ref", "critic")
    bare = throughput_metrics(config, roles, [seq] * rows, {"iteration": bare_s})
    peak = gpu_spec(config.cluster.gpu_type).peak_bf16_tflops
    planned = planner.plan(config)
    out = {
        "seq": seq, "rows": rows, "kernels": describe_kernels(config), "build_models_s": build_s,
        "first_iteration_s": warmup_s,
        "iteration_s": iteration_s, "bare_passes_s": bare_s, "tokens_per_s": rows * seq / iteration_s,
        "mfu_iteration": metrics["perf/tflops_per_gpu"] / peak, "mfu_bare": bare["perf/tflops_per_gpu"] / peak,
        "iteration_over_bare": iteration_s / bare_s, "planned_peak_gib": planned.peak_gib,
        "planned_phases_gib": planned.phases_gib,
        "actor_parameters": sum(p.numel() for c in trainer.actor.chunks for p in c.parameters()),
        "pass_notes": packed_passes, "computed_over_real": metrics["perf/padded_over_real_tokens"],
        "packed_attention_paths_run": sorted(PACKED_PATHS_RUN),
        "perf": {key: value for key, value in metrics.items() if key.startswith(("perf/", "timing/"))},
        "padded_iteration_s": padded_s, "packed_over_padded": iteration_s / padded_s, "profile": profiled,
        "padded_computed_over_real": padded_metrics.get("perf/padded_over_real_tokens", float("nan")),
        "shape": shape.describe(), "sized": sized.describe(), "oom_backoff": backoff,
        "measured_after_backoff": bool(measured_after["retries"]), **memory,
    }  # fmt: skip
    if memory:
        out["planned_over_measured"] = planned.peak_gib / memory["measured_peak_gib"]
    out["ok"] = not backoff["retries"]  # a figure measured after a back-off is not the shape's: it fails
    return out


def table_lines(b: dict[str, Any], shape: str) -> list[str]:
    header = (f"(b) PPO iteration, {shape:<18}tokens  iter s  tokens/s  MFU iter  MFU bare  iter/bare  peak GiB  "
              "planned GiB  computed/real  padded s  packed/padded")  # fmt: skip
    if "iteration_s" not in b:
        return [header, f"    FAILED {b.get('error', '')[:300]}"]
    lines = [header, (
        f"    {b['rows']} rows × {b['seq']:<5}                {b['rows'] * b['seq']:>7} {b['iteration_s']:7.2f} "
        f"{b['tokens_per_s']:9,.0f} {b['mfu_iteration']:8.1%} {b['mfu_bare']:9.1%} {b['iteration_over_bare']:10.2f} "
        f"{b.get('measured_peak_gib', float('nan')):9.1f} {b['planned_peak_gib']:12.1f} "
        f"{b['computed_over_real']:14.3f} {b['padded_iteration_s']:9.2f} {b['packed_over_padded']:14.3f}"
    )]  # fmt: skip
    lines.append(f"      ran {b['shape']} (sized to the card: {b['sized']})")
    if b["oom_backoff"]["retries"]:
        lines.append(f"      FAILED: out of memory, backed off {b['oom_backoff']['retries']} time(s) to "
                     f"{b['oom_backoff']['lowered']}: the figures above are "
                     f"{'a smaller shape' if b['measured_after_backoff'] else 'partly a smaller shape'}'s")  # fmt: skip
    phases = ", ".join(f"{key.removeprefix('perf/mfu/')} {value:.1%}" for key, value in b["perf"].items()
                       if key.startswith("perf/mfu/"))  # fmt: skip
    if phases:
        lines.append(
            f"      MFU by phase: {phases}; packed attention ran: {', '.join(b['packed_attention_paths_run'])}"
        )
    if b.get("profile"):
        profiled = b["profile"]
        top = "; ".join(f"{k['name'][:48]} {k['share']:.0%}" for k in profiled["top"][:5])
        lines.append(f"      profiled: device busy {profiled['device_busy_share']:.0%} of the wall time; top: {top}")
    return lines
