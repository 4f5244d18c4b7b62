"""Part (g) of the GPU check: the first PPO iteration's metrics where their values are known. The iteration of
part (b) (at its first length: one mini-batch, one epoch) updates the actor once, on the experience it has just
computed itself, so the policy that scores the update is the behaviour policy: the PPO KL must vanish and no ratio
may be clipped — which also pins that the training forward agrees with the experience forward on this device.
The critic's first gradient norm must stay bounded (a fresh value head on ±1 rewards)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gpu_plan import ppo_config, synthetic_rows

PPO_KL_BOUND = 1e-6  # |actor/ppo_kl| with actor = behaviour policy
CRITIC_GRAD_NORM_BOUND = 10.0  # 10 × critic clip_grad: before clipping, on returns of ±1 from a fresh value head


def check_first_update(plan, work: Path) -> dict[str, Any]:
    from megatron_ppo.train.ppo import PPOTrainer

    seq = plan.seq_lengths[0]
    config = ppo_config(plan, seq, work / "first_update")
    trainer = PPOTrainer(config, synthetic_rows(plan, seq, seed=seq + 3), pad_id=0)
    try:
        metrics = trainer.iteration()
    finally:
        trainer.close()
    kl, clipped, critic_norm = metrics["actor/ppo_kl"], metrics["actor/pg_clipfrac"], metrics["critic/grad_norm"]
    return {"ppo_kl": kl, "pg_clipfrac": clipped, "critic_grad_norm": critic_norm,
            "bounds": {"ppo_kl": PPO_KL_BOUND, "pg_clipfrac": 0.0, "critic_grad_norm": CRITIC_GRAD_NORM_BOUND},
            "ok": abs(kl) < PPO_KL_BOUND and clipped == 0.0 and critic_norm < CRITIC_GRAD_NORM_BOUND}  # fmt: skip


def table_lines(g: dict[str, Any]) -> list[str]:
    if "ppo_kl" not in g:
        return [f"(g) first update, actor = behaviour   FAILED {g.get('error', '')[:300]}"]
    return [f"(g) first update, actor = behaviour   {'ok' if g['ok'] else 'FAILED'}  |ppo_kl| {abs(g['ppo_kl']):.1e} "
            f"(< {PPO_KL_BOUND:.0e}), pg_clipfrac {g['pg_clipfrac']:.3f} (= 0), critic grad norm "
            f"{g['critic_grad_norm']:.3f} (< {CRITIC_GRAD_NORM_BOUND:g})"]  # fmt: skip
