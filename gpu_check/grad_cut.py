"""Part (e) of the GPU check: the gradient norm of one actor mini-batch (the PPO loss through Megatron's schedule on
the device) is the same whether the mini-batch is cut into 1, 2 or 4 micro-batches — the loss normalisation's
promise, and what the out-of-memory back-off relies on when it changes the cut. Gate: ≤ 1e-3 relative."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from gpu_check.plan import Plan, ppo_config, synthetic_rows
from gpu_check.sizing import START_S, Sized, build_s, iteration_flops, largest_fitting, shrinking

TOLERANCE = 1e-3
CUTS = (1, 2, 4)


def size(plan: Plan) -> Sized:
    """(e) on `plan.card`: the largest mini-batch whose cut 1 — every row in one micro-batch — fits (fewer rows,
    then shorter rows, at least `max(CUTS)` rows so every cut divides it); its planned peak is the cut-1 update's."""
    from megatron_ppo.planner import plan as planner

    base = plan.base_shape(plan.seq_lengths[0])
    base = dataclasses.replace(base, micro_batch=base.rows)

    def cost(shape) -> Sized:  # the experience, and an actor forward-backward per cut: about 1.5 iterations
        config = ppo_config(plan, shape)
        return Sized(shape, 0.0, True, flops=1.5 * iteration_flops(config), fixed_s=START_S + build_s(config))

    return largest_fitting(plan.card, shrinking(base, whole_mini_batch=True, min_rows=max(CUTS)),
                           lambda shape: planner.plan(ppo_config(plan, shape)).peak_gib, cost)  # fmt: skip


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

    sized = size(plan)
    shape = sized.shape
    config = ppo_config(plan, shape, work / "grad_cut")
    rows = synthetic_rows(plan, shape, seed=shape.seq + 1)
    trainer = PPOTrainer(config, rows, pad_id=0)
    try:
        batch = to_device(collate(rows[: shape.rows], pad_id=0), current_device(), "the grad-cut check's batch")
        passes = forward_passes(config, batch, trainer.actor, trainer.ref, trainer.critic)
        experience, _ = compute_advantages(config, batch, passes, None, None)
        actor, optimizer = trainer.actor, trainer.optimizers["actor"]
        loss = actor_loss(config.actor, mini_batch_counts(experience), 0.1, actor.vocab_size,
                          actor.logprob_chunk_tokens)  # fmt: skip
        norms = {}
        for cut in CUTS:
            zero_grads(actor, optimizer)
            _, _, micro = replica_micro_batches(experience, -(-shape.rows // cut))
            run_micro_batches(actor, micro, loss, forward_only=False)
            optimizer.prepare_grads()
            norms[cut] = float(optimizer.get_grad_norm())
        zero_grads(actor, optimizer)
    finally:
        trainer.close()
    worst = max(abs(norms[cut] - norms[1]) / max(abs(norms[1]), 1e-12) for cut in CUTS)
    return {"grad_norms": norms, "largest_relative_difference": worst, "tolerance": TOLERANCE,
            "shape": shape.describe(), "sized": sized.describe(), "ok": worst <= TOLERANCE}  # fmt: skip


def table_lines(e: dict[str, Any]) -> list[str]:
    if "grad_norms" not in e:
        return [f"(e) grad norm by micro-batch cut      FAILED {e.get('error', '')[:300]}"]
    norms = ", ".join(f"{cut}: {norm:.6g}" for cut, norm in e["grad_norms"].items())
    return [f"(e) grad norm by micro-batch cut      {'ok' if e['ok'] else 'FAILED'}  {norms}; relative difference "
            f"{e['largest_relative_difference']:.1e} (≤ {e['tolerance']:.0e}); cut 1 = {e['shape']}"]  # fmt: skip
