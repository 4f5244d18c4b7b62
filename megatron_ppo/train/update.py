"""The PPO update: `ppo_epochs` × mini-batches × micro-batches of actor and critic through Megatron's schedule.

Each loss is normalised by the token/sequence counts of the whole mini-batch (all micro-batches, all
data-parallel replicas), so the gradient does not depend on how the mini-batch is cut. Metrics come back as sums
and counts per micro-batch and are reduced to mini-batch means (last pipeline stage only).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from megatron.core import parallel_state

from megatron_ppo import algo
from megatron_ppo.config.schema import ActorConfig, CriticConfig
from megatron_ppo.models import RoleModel, run_micro_batches, vocab_parallel_log_probs
from megatron_ppo.parallel.collectives import gather_data_parallel
from megatron_ppo.train.batch import Batch, replica_micro_batches, select
from megatron_ppo.train.optimizer import StepResult, optimizer_step, zero_grads

Metrics = dict[str, float]


def _counts(batch: Batch) -> dict[str, float]:
    mask = batch["loss_mask"]
    return {
        "dp_size": parallel_state.get_data_parallel_world_size(),
        "batch_num_tokens": float(mask.sum()),
        "global_batch_size": float((mask.sum(-1) > 0).sum()),
    }


def _token_mean_parts(name: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, tuple[float, float]]:
    return {name: (float((values * mask).sum()), float(mask.sum()))}


def actor_loss(config: ActorConfig, counts: dict[str, float], kl_loss_coef: float, vocab_size: int) -> Callable:
    """loss = clipped surrogate + β_loss·KL(π‖π_ref) − entropy_coeff·H, each aggregated by `loss_agg_mode`."""
    agg = {"loss_agg_mode": config.loss_agg_mode, **counts}

    def loss_fn(batch: Batch, logits: torch.Tensor):
        mask = batch["loss_mask"]
        log_prob, entropy = vocab_parallel_log_probs(logits, batch["labels"], vocab_size=vocab_size, with_entropy=True)
        is_weights = None
        if config.behavior_is_cap is not None and "behavior_log_prob" in batch:
            is_weights = algo.truncated_is_weights(
                batch["old_log_prob"], batch["behavior_log_prob"], mask, cap=config.behavior_is_cap,
                level=config.behavior_is_level,
            )  # fmt: skip
        pg_loss, pg_metrics = algo.policy_loss(
            batch["old_log_prob"], log_prob, batch["advantages"], mask, clip_ratio_low=config.clip_ratio_low,
            clip_ratio_high=config.clip_ratio_high, clip_ratio_c=config.clip_ratio_c, is_weights=is_weights, **agg,
        )  # fmt: skip
        loss = pg_loss
        parts = {"actor/pg_loss": (float(pg_loss.detach()), 1.0)}
        if config.use_kl_loss:
            kl = algo.kl_penalty(log_prob, batch["ref_log_prob"], config.kl_loss_type)
            kl_loss = algo.agg_loss(kl, mask, **agg)
            loss = loss + kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = (float(kl_loss.detach()), 1.0)
        if config.entropy_coeff > 0:
            loss = loss - config.entropy_coeff * algo.agg_loss(entropy, mask, **agg)
        tokens = float(mask.sum())
        parts |= _token_mean_parts("actor/entropy", entropy.detach(), mask)
        parts |= {f"actor/{k}": (float(v) * tokens, tokens) for k, v in pg_metrics.items()}
        return loss, parts

    return loss_fn


def critic_loss(config: CriticConfig, counts: dict[str, float]) -> Callable:
    """½·clipped value loss, aggregated by `loss_agg_mode`."""
    agg = {"loss_agg_mode": config.loss_agg_mode, **counts}

    def loss_fn(batch: Batch, output: torch.Tensor):
        mask = batch["loss_mask"]
        values = output.squeeze(-1).float()
        loss, clipfrac = algo.value_loss(
            values, batch["returns"], batch["values"], mask, cliprange_value=config.cliprange_value, **agg
        )
        tokens = float(mask.sum())
        parts = {
            "critic/vf_loss": (float(loss.detach()), 1.0),
            "critic/vf_clipfrac": (float(clipfrac) * tokens, tokens),
        }
        return loss, parts | _token_mean_parts("critic/vpred_mean", values.detach(), mask)

    return loss_fn


def _reduce(outputs: list[dict[str, tuple[float, float]]]) -> Metrics:
    """Mini-batch means from micro-batch (sum, count) parts, over data-parallel replicas too.

    Losses (keys ending in "_loss") are already normalised by global counts × DP: summed, then divided by DP.
    """
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, float] = defaultdict(float)
    for replica in gather_data_parallel(outputs):
        for output in replica:
            for key, (value, count) in output.items():
                sums[key] += value
                counts[key] += count
    dp = parallel_state.get_data_parallel_world_size()
    return {k: sums[k] / dp if k.endswith("_loss") else sums[k] / max(counts[k], 1e-9) for k in sums}


def update_role(
    model: RoleModel,
    optimizer,
    scheduler,
    batch: Batch,
    *,
    epochs: int,
    mini_batch_size: int,
    micro_batch_size: int | None,
    max_tokens: int | None,
    clip_grad: float,
    make_loss: Callable[[dict[str, float]], Callable],
) -> tuple[list[Metrics], list[StepResult]]:
    """Train `model` on `batch` (identical on every replica) for `epochs` passes over its mini-batches."""
    rows = batch["input_ids"].shape[0]
    metrics, steps = [], []
    for _ in range(epochs):
        for start in range(0, rows, mini_batch_size):
            mini = select(batch, range(start, min(start + mini_batch_size, rows)))
            _, _, micro = replica_micro_batches(mini, micro_batch_size, max_tokens)
            zero_grads(model, optimizer)
            outputs = run_micro_batches(model, micro, make_loss(_counts(mini)), forward_only=False)
            result = optimizer_step(optimizer, clip_grad)
            if not result.skipped:
                scheduler.step(1)
            steps.append(result)
            if outputs:
                metrics.append(_reduce(outputs))
    return metrics, steps
