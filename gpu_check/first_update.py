"""Part (g) of the GPU check: the first PPO iteration's metrics where their values are known. The iteration of
part (b) (at its first length: one mini-batch, one epoch) updates the actor once, on the experience it has just
computed itself, so the policy that scores the update is the behaviour policy: the PPO KL must vanish and no ratio
may be clipped — which also pins that the training forward agrees with the experience forward on this device.
The critic's first gradient norm must stay bounded (a fresh value head on ±1 rewards). Then the trainer is closed
and dropped with the cycle collector off: its models and optimizers must be gone (weak references), and on CUDA the
allocator must be back within `LEFT_BOUND_MIB` of what it held before the trainer was built (what may stay: RoPE's
cached frequencies, Megatron's global buffers, ~0.5 MiB at this shape).

What torch keeps by design is not counted: cuBLAS takes a 32 MiB workspace from the caching allocator per handle
and stream and keeps it for the life of the process — the forward's matrix products run on the main thread, the
backward's on autograd's device thread, so two workspaces, 64 MiB, on sm90 — so both readings of the allocator
release those workspaces first (`torch._C._cuda_clearCublasWorkspaces`), and what is left is the trainer's own.

The gate on the KL depends on the attention kernel that ran (`attention_kernel`): the experience's no-grad forward
and the update's training forward give the same bits where both run one kernel (flash, memory-efficient, the CPU's);
cuDNN's attention (which torch 2.11 prefers on sm90, grouped heads included) and Transformer Engine's fused
attention build separate graphs for the two, which round bf16 differently, so there the KL and the clip fraction
are held to bf16 noise (`NOISE_BOUND`) rather than zero. Unmeasured on a GPU so far: the bound is an estimate (a
per-token difference of a few hundredths of a nat, bf16 against fp32 in (c), averages to ~1e-4 over 64k tokens)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import torch

from gpu_check.plan import Plan, backoff_record, ppo_config, synthetic_rows
from gpu_check.sizing import START_S, Sized, build_s, iteration_flops, largest_fitting, shrinking

PPO_KL_BOUND = 1e-6  # |actor/ppo_kl| with actor = behaviour policy, one attention kernel for both forwards
NOISE_BOUND = 1e-3  # |actor/ppo_kl| and actor/pg_clipfrac where the two forwards run different graphs (docstring)
BITWISE_KERNELS = ("flash", "memory-efficient", "math")
CRITIC_GRAD_NORM_BOUND = 10.0  # 10 × critic clip_grad: before clipping, on returns of ±1 from a fresh value head
LEFT_BOUND_MIB = 64.0
MIB = 1024**2


def size(plan: Plan) -> Sized:
    """(g) on `plan.card`: (b)'s first length, padded rows (as the trainer's default), sized as (b); one iteration."""
    from megatron_ppo.planner import plan as planner

    def cost(shape) -> Sized:
        config = ppo_config(plan, shape)
        return Sized(shape, 0.0, True, flops=iteration_flops(config), fixed_s=START_S + build_s(config))

    return largest_fitting(plan.card, shrinking(plan.base_shape(plan.seq_lengths[0])),
                           lambda shape: planner.plan(ppo_config(plan, shape)).peak_gib, cost)  # fmt: skip


def allocated_bytes() -> int:
    """What the caching allocator holds for tensors, torch's cuBLAS workspaces released first (module docstring);
    0 on the CPU."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


def attention_kernel(config) -> str:
    """The attention kernel the actor's padded forwards run: Transformer Engine's, or the backend torch's SDPA
    dispatcher picks for them (`models.kernels.sdpa_backend`)."""
    from megatron_ppo.models.kernels import sdpa_backend, uses_transformer_engine

    return "Transformer Engine" if uses_transformer_engine(config.model) else sdpa_backend(config)


def check_first_update(plan, work: Path) -> dict[str, Any]:
    from megatron_ppo.train.ppo import PPOTrainer

    sized = size(plan)
    shape = sized.shape
    config = ppo_config(plan, shape, work / "first_update")
    rows = synthetic_rows(plan, shape, seed=shape.seq + 3)
    kernel = attention_kernel(config)
    bitwise = kernel in BITWISE_KERNELS
    kl_bound, clip_bound = (PPO_KL_BOUND, 0.0) if bitwise else (NOISE_BOUND, NOISE_BOUND)
    gc.collect()
    gc.disable()  # what is freed below is freed by reference counting alone
    try:
        before = allocated_bytes()
        trainer = PPOTrainer(config, rows, pad_id=0)
        try:
            metrics = trainer.iteration()
            peak = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
            backoff = backoff_record(trainer)
        finally:
            trainer.close()
        held = [weakref.ref(x) for x in (trainer, *trainer.roles.built().values(), *trainer.optimizers.values())]
        del trainer
        alive = sum(ref() is not None for ref in held)
        left_mib = (allocated_bytes() - before) / MIB
    finally:
        gc.enable()
    kl, clipped, critic_norm = metrics["actor/ppo_kl"], metrics["actor/pg_clipfrac"], metrics["critic/grad_norm"]
    return {"ppo_kl": kl, "pg_clipfrac": clipped, "critic_grad_norm": critic_norm, "alive_after_drop": alive,
            "allocated_during_mib": (peak - before) / MIB, "allocated_left_mib": left_mib,
            "attention_kernel": kernel, "cublas_workspaces_released": torch.cuda.is_available(),
            "shape": shape.describe(), "oom_backoff": backoff,
            "bounds": {"ppo_kl": kl_bound, "pg_clipfrac": clip_bound, "critic_grad_norm": CRITIC_GRAD_NORM_BOUND,
                       "allocated_left_mib": LEFT_BOUND_MIB},
            "ok": abs(kl) < kl_bound and clipped <= clip_bound and critic_norm < CRITIC_GRAD_NORM_BOUND
                  and alive == 0 and left_mib <= LEFT_BOUND_MIB and not backoff["retries"]}  # fmt: skip


def table_lines(g: dict[str, Any]) -> list[str]:
    if "ppo_kl" not in g:
        return [f"(g) first update, actor = behaviour   FAILED {g.get('error', '')[:300]}"]
    bounds = g["bounds"]
    clip = "= 0" if bounds["pg_clipfrac"] == 0 else f"≤ {bounds['pg_clipfrac']:.0e}"
    backoff = g["oom_backoff"]
    after = f"; FAILED: out of memory, backed off {backoff['retries']} time(s)" if backoff["retries"] else ""
    workspaces = ", cuBLAS workspaces released" if g["cublas_workspaces_released"] else ""
    return [f"(g) first update, actor = behaviour   {'ok' if g['ok'] else 'FAILED'}  |ppo_kl| {abs(g['ppo_kl']):.1e} "
            f"(< {bounds['ppo_kl']:.0e}, attention {g['attention_kernel']}), pg_clipfrac {g['pg_clipfrac']:.3f} "
            f"({clip}), critic grad norm {g['critic_grad_norm']:.3f} (< {CRITIC_GRAD_NORM_BOUND:g}); dropped: "
            f"{g['alive_after_drop']} objects alive (= 0), {g['allocated_left_mib']:.1f} MiB of "
            f"{g['allocated_during_mib']:.0f} left allocated (≤ {LEFT_BOUND_MIB:g}{workspaces}); ran {g['shape']}"
            f"{after}"]  # fmt: skip
