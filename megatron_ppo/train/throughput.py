"""Measured throughput of a PPO iteration: model FLOPs utilisation per phase, from the planner's FLOP count.

    perf/mfu/experience = FLOPs(experience) / (timing/experience_s · GPUs · peak)
    perf/mfu/actor      = FLOPs(actor update) / (timing/update_actor_s · GPUs · peak)
    perf/mfu/critic     = FLOPs(critic update) / (timing/update_critic_s · GPUs · peak)
    perf/tflops_per_gpu = FLOPs(iteration) / (iteration seconds · GPUs) / 10¹²
    perf/padded_over_real_tokens = Σ tokens the models computed / Σ real tokens (1: no padding)

FLOPs come from `megatron_ppo.flops.iteration_flops` (the same function the planner's step-time estimate uses),
over the batch's real tokens: Σ row lengths, with causal attention by Σ (row length)² / 2 as Megatron-LM counts it
(`planner.flops.pass_flops`). The experience is the forward passes of every built role (reference, actor, critic);
each phase's MFU is over the trainer's own timer of that phase. The peak is the dense bf16 tensor-core peak of
`cluster.gpu_type` (`config/gpus.py`).

The trainer calls, once per iteration, after timing its phases on the host:

    metrics |= throughput_metrics(config, roles, batch["lengths"], timings) | timing_metrics(timings)
    metrics |= padding_metrics(models)

with `roles` the built roles (("actor", "ref", "critic") or fewer) and `timings = {"experience": s,
"update_actor": s, "update_critic": s, "iteration": s}` in seconds, keyed by each `Phase`'s `metric` name (phases
that did not run are left out), each phase timed with `phase_timer`, which waits for the GPU's queued kernels so
none is counted in the next phase.
The padding ratio counts every pass of the iteration (experience and updates, this rank's micro-batches): the rows
of a micro-batch padded to its longest, widths bucketed, one shape per pipeline pass (`models.widths`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from megatron_ppo.config.gpus import gpu_spec
from megatron_ppo.config.layout import world_size
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.models.gpt import RoleModel
from megatron_ppo.parallel.device import on_cuda
from megatron_ppo.planner.flops import flop_parameter_count, iteration_flops
from megatron_ppo.planner.phases import Phase

TIMED = (Phase.EXPERIENCE, Phase.UPDATE_ACTOR, Phase.UPDATE_CRITIC)  # the phases with a timing and a FLOP count


def throughput_metrics(
    config: PPOConfig, roles: Sequence[str], lengths: Sequence[int] | torch.Tensor, timings: dict[str, float]
) -> dict[str, float]:
    """`perf/mfu/experience`, `perf/mfu/actor`, `perf/mfu/critic` (for the phases that ran) and
    `perf/tflops_per_gpu` of one iteration
    of the built `roles` over rows of `lengths` tokens (the whole batch, all data-parallel ranks); `timings` holds
    the seconds of each phase that ran and of the whole iteration."""
    params = {role: flop_parameter_count(config.model, role) for role in roles}
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    flops = iteration_flops(config, params, float(lengths.sum()), float((lengths**2).sum()))
    gpus = world_size(config)
    ran = {phase: flops[phase] for phase in TIMED if phase in flops and phase.metric in timings}
    out = {"perf/tflops_per_gpu": sum(ran.values()) / (timings["iteration"] * gpus) / 1e12}
    peak = gpu_spec(config.cluster.gpu_type).peak_bf16_tflops
    for phase in TIMED:
        if phase in ran and timings[phase.metric] > 0:
            out[f"perf/mfu/{phase.trained_role or phase.metric}"] = ran[phase] / (
                timings[phase.metric] * gpus * peak * 1e12
            )
    return out


def padding_metrics(models: Sequence[RoleModel]) -> dict[str, float]:
    """`perf/padded_over_real_tokens`: the tokens `models` computed (rows × width of each micro-batch as it entered
    the model) over the real ones (Σ row lengths), summed over their passes since the tallies were last cleared."""
    padded = sum(model.padding.padded for model in models)
    real = sum(torch.as_tensor(model.padding.real, dtype=torch.float64).cpu() for model in models)
    return {"perf/padded_over_real_tokens": padded / float(real)} if padded else {}


def timing_metrics(timings: dict[str, float]) -> dict[str, float]:
    """`timing/experience_s`, `timing/update_actor_s`, `timing/update_critic_s` for the phases that ran."""
    return {f"timing/{phase.metric}_s": timings[phase.metric] for phase in TIMED if phase.metric in timings}


@contextmanager
def phase_timer(timings: dict[str, float], phase: str) -> Iterator[None]:
    """Time the enclosed phase into `timings[phase]`, waiting for this GPU's queued kernels at both ends."""
    if on_cuda():
        torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if on_cuda():
            torch.cuda.synchronize()
        timings[phase] = time.perf_counter() - start
