"""Experience for one PPO iteration: forward passes (no grad) of actor, reference and critic, then token rewards
and advantages. Runs on every rank; the results exist on the last pipeline stage (elsewhere they are `None`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_ppo import algo
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.models import RoleModel, run_micro_batches, vocab_parallel_log_probs
from megatron_ppo.parallel.collectives import gather_data_parallel, is_last_stage, undo_share
from megatron_ppo.train.batch import Batch, replica_micro_batches


def forward_per_token(
    model: RoleModel,
    batch: Batch,
    output_fn: Callable[[Batch, torch.Tensor], torch.Tensor],
    micro_batch_size: int | None,
    max_tokens: int | None,
) -> torch.Tensor | None:
    """`output_fn(micro_batch, model_output)` → `[rows, width]` for every row of `batch`, computed on this replica's
    share and gathered over data-parallel ranks; `None` off the last pipeline stage."""
    share, groups, micro = replica_micro_batches(batch, micro_batch_size, max_tokens)
    outputs = run_micro_batches(
        model, micro, lambda b, out: (torch.zeros(()), {"value": output_fn(b, out)}), forward_only=True
    )
    if not is_last_stage():
        return None
    width = batch["input_ids"].shape[1]
    per_row: list[torch.Tensor] = [None] * len(share)  # type: ignore[list-item]
    for group, output in zip(groups, outputs, strict=True):
        for position, row in enumerate(group):
            per_row[row] = torch.nn.functional.pad(output["value"][position], (0, width - output["value"].shape[1]))
    return torch.stack(undo_share(gather_data_parallel(per_row)))


def log_prob_fn(model: RoleModel) -> Callable[[Batch, torch.Tensor], torch.Tensor]:
    def fn(batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_log_probs(logits, batch["labels"], vocab_size=model.vocab_size)[0].detach()

    return fn


def values_fn(batch: Batch, output: torch.Tensor) -> torch.Tensor:
    return output.squeeze(-1).float().detach()


@torch.no_grad()
def compute_experience(
    config: PPOConfig, batch: Batch, actor: RoleModel, ref: RoleModel | None, critic: RoleModel | None
) -> Batch | None:
    """Adds `old_log_prob`, `ref_log_prob` (when a KL term is on) and `values` (GAE) to `batch`."""
    micro = config.actor.log_prob_micro_batch_size_per_gpu
    tokens = config.actor.ppo_max_token_len_per_gpu if config.actor.use_dynamic_bsz else None
    for model in (actor, ref, critic):
        if model is not None:
            for chunk in model.chunks:
                chunk.eval()
    out = dict(batch)
    out["old_log_prob"] = forward_per_token(actor, batch, log_prob_fn(actor), micro, tokens)
    if ref is not None:
        out["ref_log_prob"] = forward_per_token(ref, batch, log_prob_fn(ref), micro, tokens)
    if critic is not None:
        out["values"] = forward_per_token(critic, batch, values_fn, micro, tokens)
    for model in (actor, critic):
        if model is not None:
            for chunk in model.chunks:
                chunk.train()
    return out if is_last_stage() else None


def compute_advantages(
    config: PPOConfig, batch: Batch, reward_kl_coef: float | None, normalizer: algo.RunningRewardNormalizer | None
) -> tuple[Batch, dict[str, float]]:
    """Token rewards (clipped/normalised sequence score on the last response token, minus β·KL when the KL is in
    the reward), then GAE or GRPO advantages. Returns the batch with `token_level_rewards`, `advantages`, `returns`
    and the reward metrics."""
    mask = batch["loss_mask"]
    scores = batch["scores"]
    has_score = ~torch.isnan(scores)
    clipped = algo.clip_rewards(torch.nan_to_num(scores), _clip_range(config))
    if normalizer is not None:
        normalizer.update(clipped[has_score])
        clipped = normalizer.normalize(clipped)
    token_scores = torch.where(
        has_score[:, None], algo.scores_to_token_level(clipped, mask), batch["token_level_scores"]
    )
    metrics = {"reward/mean": float(token_scores.sum(-1).mean())}
    rewards = token_scores
    if reward_kl_coef is not None:
        kl = algo.kl_penalty(batch["old_log_prob"], batch["ref_log_prob"], config.algorithm.kl_penalty) * mask
        rewards = algo.kl_penalized_rewards(token_scores, kl, reward_kl_coef, mask)
        metrics["kl/reward_penalty"] = float(algo.masked_mean(kl, mask, dim=-1).mean())
    if config.algorithm.adv_estimator == "gae":
        advantages, returns = algo.gae_advantages(
            rewards, batch["values"], mask, config.algorithm.gamma, config.algorithm.lam
        )
    else:
        advantages, returns = algo.grpo_advantages(
            rewards, mask, batch["group"], norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo
        )
    return {**batch, "token_level_rewards": rewards, "advantages": advantages, "returns": returns}, metrics


def _clip_range(config: PPOConfig) -> tuple[float, float] | None:
    clip = config.reward.clip_range
    return None if clip is None else (clip[0], clip[1])
