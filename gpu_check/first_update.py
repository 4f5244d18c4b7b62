"""Part (g) of the GPU check: the first PPO iteration's metrics where their values are known. The iteration of
part (b) (at its first length: one mini-batch, one epoch) updates the actor once, on the experience it has just
computed itself, so the policy that scores the update is the behaviour policy: the PPO KL must vanish and no ratio
may be clipped — which also pins that the training forward agrees with the experience forward on this device.
The critic's first gradient norm must stay bounded (a fresh value head on ±1 rewards). Then the trainer is closed
and dropped with the cycle collector off: its models and optimizers must be gone (weak references), and on CUDA the
allocator must be back within `LEFT_BOUND_MIB` of what it held before the trainer was built (what may stay: RoPE's
cached frequencies, Megatron's global buffers)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import torch

from gpu_check.plan import ppo_config, synthetic_rows

PPO_KL_BOUND = 1e-6  # |actor/ppo_kl| with actor = behaviour policy
CRITIC_GRAD_NORM_BOUND = 10.0  # 10 × critic clip_grad: before clipping, on returns of ±1 from a fresh value head
LEFT_BOUND_MIB = 64.0
MIB = 1024**2


def check_first_update(plan, work: Path) -> dict[str, Any]:
    from megatron_ppo.train.ppo import PPOTrainer

    seq = plan.seq_lengths[0]
    config = ppo_config(plan, seq, work / "first_update")
    rows = synthetic_rows(plan, seq, seed=seq + 3)
    gc.collect()
    gc.disable()  # what is freed below is freed by reference counting alone
    try:
        before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        trainer = PPOTrainer(config, rows, pad_id=0)
        try:
            metrics = trainer.iteration()
            peak = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        finally:
            trainer.close()
        held = [weakref.ref(x) for x in (trainer, *trainer._built_roles().values(), *trainer.optimizers.values())]
        del trainer
        alive = sum(ref() is not None for ref in held)
        left_mib = ((torch.cuda.memory_allocated() if torch.cuda.is_available() else 0) - before) / MIB
    finally:
        gc.enable()
    kl, clipped, critic_norm = metrics["actor/ppo_kl"], metrics["actor/pg_clipfrac"], metrics["critic/grad_norm"]
    return {"ppo_kl": kl, "pg_clipfrac": clipped, "critic_grad_norm": critic_norm, "alive_after_drop": alive,
            "allocated_during_mib": (peak - before) / MIB, "allocated_left_mib": left_mib,
            "bounds": {"ppo_kl": PPO_KL_BOUND, "pg_clipfrac": 0.0, "critic_grad_norm": CRITIC_GRAD_NORM_BOUND,
                       "allocated_left_mib": LEFT_BOUND_MIB},
            "ok": abs(kl) < PPO_KL_BOUND and clipped == 0.0 and critic_norm < CRITIC_GRAD_NORM_BOUND
                  and alive == 0 and left_mib <= LEFT_BOUND_MIB}  # fmt: skip


def table_lines(g: dict[str, Any]) -> list[str]:
    if "ppo_kl" not in g:
        return [f"(g) first update, actor = behaviour   FAILED {g.get('error', '')[:300]}"]
    return [f"(g) first update, actor = behaviour   {'ok' if g['ok'] else 'FAILED'}  |ppo_kl| {abs(g['ppo_kl']):.1e} "
            f"(< {PPO_KL_BOUND:.0e}), pg_clipfrac {g['pg_clipfrac']:.3f} (= 0), critic grad norm "
            f"{g['critic_grad_norm']:.3f} (< {CRITIC_GRAD_NORM_BOUND:g}); dropped: {g['alive_after_drop']} objects "
            f"alive (= 0), {g['allocated_left_mib']:.1f} MiB of {g['allocated_during_mib']:.0f} left allocated "
            f"(≤ {LEFT_BOUND_MIB:g})"]  # fmt: skip
