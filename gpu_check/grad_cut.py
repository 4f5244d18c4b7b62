"""Part (e) of the GPU check: the gradient norm of one actor mini-batch (the PPO loss through Megatron's schedule on
the device) is the same whether the mini-batch is cut into 1, 2 or 4 micro-batches — the loss normalisation's
promise, and what the out-of-memory back-off relies on when it changes the cut. Gate: ≤ 1e-3 relative."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_check.plan import ppo_config, synthetic_rows

TOLERANCE = 1e-3
CUTS = (1, 2, 4)


def check_grad_norm_by_cut(plan, work: Path) -> dict[str, Any]:
    """(e): experience from the trainer's own passes on `plan.rows` rows of the first length (on the device),
    then the actor's gradient norm (Megatron's optimizer, before any step) for each cut."""
    from megatron_ppo.models import run_micro_batches
    from megatron_ppo.parallel.device import current_device, to_device
    from megatron_ppo.train.batch import collate, replica_micro_batches
    from megatron_ppo.train.experience import compute_advantages, forward_passes
    from megatron_ppo.train.optimizer import zero_grads
    from megatron_ppo.train.ppo import PPOTrainer
    from megatron_ppo.train.update import actor_loss, mini_batch_counts

    seq = plan.seq_lengths[0]
    config = ppo_config(plan, seq, work / "grad_cut")
    rows = synthetic_rows(plan, seq, seed=seq + 1)
    trainer = PPOTrainer(config, rows, pad_id=0)
    try:
        batch = to_device(collate(rows[: plan.rows], pad_id=0), current_device(), "the grad-cut check's batch")
        passes = forward_passes(config, batch, trainer.actor, trainer.ref, trainer.critic)
        experience, _ = compute_advantages(config, batch, passes, None, None)
        actor, optimizer = trainer.actor, trainer.optimizers["actor"]
        loss = actor_loss(config.actor, mini_batch_counts(experience), 0.1, actor.vocab_size,
                          actor.logprob_chunk_tokens)  # fmt: skip
        norms = {}
        for cut in CUTS:
            zero_grads(actor, optimizer)
            _, _, micro = replica_micro_batches(experience, -(-plan.rows // cut))
            run_micro_batches(actor, micro, loss, forward_only=False)
            optimizer.prepare_grads()
            norms[cut] = float(optimizer.get_grad_norm())
        zero_grads(actor, optimizer)
    finally:
        trainer.close()
    worst = max(abs(norms[cut] - norms[1]) / max(abs(norms[1]), 1e-12) for cut in CUTS)
    return {"grad_norms": norms, "largest_relative_difference": worst, "tolerance": TOLERANCE,
            "ok": worst <= TOLERANCE}  # fmt: skip


def table_lines(e: dict[str, Any]) -> list[str]:
    if "grad_norms" not in e:
        return [f"(e) grad norm by micro-batch cut      FAILED {e.get('error', '')[:300]}"]
    norms = ", ".join(f"{cut}: {norm:.6g}" for cut, norm in e["grad_norms"].items())
    return [f"(e) grad norm by micro-batch cut      {'ok' if e['ok'] else 'FAILED'}  {norms}; relative difference "
            f"{e['largest_relative_difference']:.1e} (≤ {e['tolerance']:.0e})"]  # fmt: skip
