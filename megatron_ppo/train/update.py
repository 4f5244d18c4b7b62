"""The PPO update: `ppo_epochs` × mini-batches × micro-batches of actor or critic through Megatron's schedule.

Each loss is normalised by the token/sequence counts of the whole mini-batch (all micro-batches, all data-parallel
replicas; see `megatron_ppo.algo.aggregation`), and `seq-mean-token-sum-norm` by the constant `loss_scale_factor`
(default `data.max_response_length`), so in every mode the gradient does not depend on how the mini-batch is cut
into micro-batches or spread over replicas. Metrics come back from each
micro-batch as parts that say how they combine (`MetricPart`) and are reduced to mini-batch values, then averaged
over the mini-batches of the update. The parts stay tensors on the model's device through Megatron's schedule: a
Python number taken inside a loss function would synchronise the device once per micro-batch (the next one could
not be queued while the GPU works); they reach the host in one transfer per mini-batch (`reduce_parts`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from megatron_ppo import algo
from megatron_ppo.config.schema import ActorConfig, CriticConfig, PPOConfig
from megatron_ppo.models import RoleModel, run_micro_batches, vocab_parallel_log_probs
from megatron_ppo.models.moe import clear_moe_aux_losses, moe_aux_loss_metrics
from megatron_ppo.models.router_replay import ROUTED_EXPERTS
from megatron_ppo.parallel.collectives import broadcast_from_last_stage, gather_data_parallel
from megatron_ppo.parallel.ranks import data_parallel
from megatron_ppo.train.batch import replica_micro_batches, select
from megatron_ppo.train.experience import Experience
from megatron_ppo.train.micro_batching import MicroBatching
from megatron_ppo.train.optimizer import StepResult, optimizer_step, zero_grads

Metrics = dict[str, float]


@dataclass(frozen=True)
class MetricPart:
    """One micro-batch's contribution to a mini-batch metric, and how contributions combine over the
    micro-batches of every data-parallel replica: "sum" Σ value; "mean" Σ value / Σ weight; "max" max value.
    Inside the schedule `value` and `weight` are detached 0-dim tensors on the model's device (no host
    synchronisation; products in float64, as Python floats would be); `reduce_parts` turns them into floats."""

    value: torch.Tensor | float
    weight: torch.Tensor | float = 1.0
    reduce: Literal["sum", "mean", "max"] = "sum"

    @classmethod
    def token_mean(cls, values: torch.Tensor, mask: torch.Tensor) -> MetricPart:
        """Contributes to the mean of `values` over the mini-batch's response tokens."""
        return cls((values.detach() * mask).sum(), mask.sum(), "mean")

    @classmethod
    def loss_share(cls, loss: torch.Tensor, dp_size: int) -> MetricPart:
        """A micro-batch loss normalised by global counts × DP (`agg_loss`): the shares sum to DP × the mini-batch
        loss over all replicas."""
        return cls(loss.detach().double() / dp_size, 1.0, "sum")


LossFn = Callable[[dict, torch.Tensor], tuple[torch.Tensor, dict[str, MetricPart]]]


def mini_batch_counts(batch: Experience) -> dict[str, float]:
    """The global normalisers of `agg_loss` for a mini-batch (identical on every replica); the role's loss adds
    its constant `loss_scale_factor`."""
    mask = batch["loss_mask"]
    return {
        "dp_size": data_parallel().size,
        "batch_num_tokens": float(mask.sum()),
        "global_batch_size": float((mask.sum(-1) > 0).sum()),
    }


def actor_loss(
    config: ActorConfig,
    counts: dict[str, float],
    kl_loss_coef: float,
    vocab_size: int,
    chunk_tokens: int | None = None,
    ref_kl_type: str | None = None,
) -> LossFn:
    """loss = policy loss (`actor.policy_loss.loss_mode`, weighted by the off-policy correction's
    `rollout_is_weights` when the experience has them) + β_loss·KL(π‖π_ref) − entropy_coeff·H, each aggregated by
    `loss_agg_mode`; log-probs and entropy over the vocabulary in chunks of `chunk_tokens` tokens
    (`model.logprob_chunk_tokens`).

    With `ref_kl_type` (a KL estimator) and reference log-probs, also the metric `actor/ref_kl`: the KL to the
    reference of the weights being trained, Σ_t KL_t·mask_t / Σ_t mask_t over the mini-batch's response tokens
    (what the KL guards read, `train/guards.py`)."""
    agg = {"loss_agg_mode": config.loss_agg_mode, "loss_scale_factor": config.loss_scale_factor, **counts}
    dp = int(counts["dp_size"])
    policy_loss = algo.get_policy_loss_fn(config.policy_loss.loss_mode)
    pg_config = policy_loss_config(config, counts)

    def loss_fn(batch: Experience, logits: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetricPart]]:
        mask = batch["loss_mask"]
        log_prob, entropy = vocab_parallel_log_probs(
            logits, batch["labels"], vocab_size=vocab_size, with_entropy=True, chunk_tokens=chunk_tokens
        )
        pg_loss, pg_metrics = policy_loss(
            batch["old_log_prob"], log_prob, batch["advantages"], mask, config.loss_agg_mode, pg_config,
            batch.get("rollout_is_weights"),
        )  # fmt: skip
        loss = pg_loss
        parts = {"actor/pg_loss": MetricPart.loss_share(pg_loss, dp)}
        if config.use_kl_loss:
            kl = algo.kl_penalty(log_prob, batch["ref_log_prob"], config.kl_loss_type)
            kl_loss = algo.agg_loss(kl, mask, **agg)
            loss = loss + kl_loss_coef * kl_loss
            parts["actor/kl_loss"] = MetricPart.loss_share(kl_loss, dp)
        if config.entropy_coeff > 0:
            loss = loss - config.entropy_coeff * algo.agg_loss(entropy, mask, **agg)
        if ref_kl_type is not None and "ref_log_prob" in batch:
            kl_to_ref = algo.kl_penalty(log_prob.detach(), batch["ref_log_prob"], ref_kl_type)
            parts["actor/ref_kl"] = MetricPart.token_mean(kl_to_ref, mask)
        tokens = mask.sum()
        parts["actor/entropy"] = MetricPart.token_mean(entropy.detach(), mask)
        # policy_loss reports token means of this micro-batch: weighted by its tokens they combine to the mini-batch's
        parts |= {f"actor/{k}": MetricPart(v.double() * tokens, tokens, "mean") for k, v in pg_metrics.items()}
        return loss, parts

    return loss_fn


def policy_loss_config(config: ActorConfig, counts: dict[str, float]) -> algo.PolicyLossConfig:
    """The policy loss's settings (verl's ActorConfig leaves) with the mini-batch counts as `global_batch_info`."""
    settings = config.policy_loss
    return algo.PolicyLossConfig(
        clip_ratio=config.clip_ratio, clip_ratio_low=config.clip_ratio_low, clip_ratio_high=config.clip_ratio_high,
        clip_ratio_c=config.clip_ratio_c, tau_pos=config.tau_pos, tau_neg=config.tau_neg,
        clip_cov_ratio=settings.clip_cov_ratio, clip_cov_lb=settings.clip_cov_lb, clip_cov_ub=settings.clip_cov_ub,
        kl_cov_ratio=settings.kl_cov_ratio, ppo_kl_coef=settings.ppo_kl_coef, dro_beta=settings.dro_beta,
        global_batch_info={**counts, "loss_scale_factor": config.loss_scale_factor},
    )  # fmt: skip


def critic_loss(config: CriticConfig, counts: dict[str, float]) -> LossFn:
    """½·clipped value loss, aggregated by `loss_agg_mode`."""
    agg = {"loss_agg_mode": config.loss_agg_mode, "loss_scale_factor": config.loss_scale_factor, **counts}
    dp = int(counts["dp_size"])

    def loss_fn(batch: Experience, output: torch.Tensor) -> tuple[torch.Tensor, dict[str, MetricPart]]:
        mask = batch["loss_mask"]
        values = output.squeeze(-1).float()
        loss, clipfrac = algo.value_loss(
            values, batch["returns"], batch["values"], mask, cliprange_value=config.cliprange_value, **agg
        )
        tokens = mask.sum()
        return loss, {
            "critic/vf_loss": MetricPart.loss_share(loss, dp),
            "critic/vf_clipfrac": MetricPart(clipfrac.double() * tokens, tokens, "mean"),
            "critic/vpred_mean": MetricPart.token_mean(values.detach(), mask),
        }

    return loss_fn


def reduce_parts(outputs: list[dict[str, MetricPart]]) -> Metrics:
    """Mini-batch values from the micro-batch parts of every data-parallel replica (and context-parallel rank: each
    holds its tokens' share of every sequence); this replica's parts reach the host in one transfer."""
    parts: dict[str, list[MetricPart]] = defaultdict(list)
    for replica in gather_data_parallel(_parts_on_host(outputs), with_context_parallel=True):
        for output in replica:
            for key, part in output.items():
                parts[key].append(part)
    out = {}
    for key, items in parts.items():
        kind = items[0].reduce
        if kind == "sum":
            out[key] = sum(p.value for p in items)
        elif kind == "max":
            out[key] = max(p.value for p in items)
        else:
            out[key] = sum(p.value for p in items) / max(sum(p.weight for p in items), 1e-9)
    return out


def _parts_on_host(outputs: list[dict[str, MetricPart]]) -> list[dict[str, MetricPart]]:
    """The same parts with Python floats for values and weights: every tensor among them stacked (as float64, so
    each float is the exact value of its float32 tensor) and copied to the host at once."""
    numbers = [x for output in outputs for part in output.values() for x in (part.value, part.weight)]
    device = next((x.device for x in numbers if isinstance(x, torch.Tensor)), None)
    if device is None:
        return outputs
    host = iter(torch.stack([torch.as_tensor(x, dtype=torch.float64, device=device) for x in numbers]).tolist())
    return [{key: MetricPart(next(host), next(host), part.reduce) for key, part in out.items()} for out in outputs]


@dataclass
class RoleUpdate:
    """What updating one role did: its metrics (means over the mini-batches, on every pipeline stage) and each
    optimizer step."""

    metrics: Metrics = field(default_factory=dict)
    steps: list[StepResult] = field(default_factory=list)

    @property
    def skipped(self) -> int:
        return sum(step.skipped for step in self.steps)


def role_loss(
    role: str, config: PPOConfig, model: RoleModel, kl_loss_coef: float, with_reference: bool
) -> Callable[[dict[str, float]], LossFn]:
    """The loss `update_role` builds for each mini-batch of `role` from its counts: the actor's (`actor_loss`, with
    this iteration's `kl_loss_coef` and, `with_reference`, the `actor/ref_kl` the KL guards read — by the loss's
    estimator when the KL is in the loss, else by the reward's) or the critic's (`critic_loss`)."""
    if role == "critic":
        return lambda counts: critic_loss(config.critic, counts)
    actor = config.actor
    kl_kind = actor.kl_loss_type if actor.use_kl_loss else config.algorithm.kl_penalty
    return lambda counts: actor_loss(
        actor, counts, kl_loss_coef=kl_loss_coef, vocab_size=model.vocab_size,
        chunk_tokens=model.logprob_chunk_tokens, ref_kl_type=kl_kind if with_reference else None,
    )  # fmt: skip


def update_role(
    role: str,
    model: RoleModel,
    optimizer,
    scheduler,
    experience: Experience,
    *,
    config: ActorConfig | CriticConfig,
    micro: MicroBatching,
    make_loss: Callable[[dict[str, float]], LossFn],
) -> RoleUpdate:
    """Train `model` on `experience` (identical on every replica) for `config.ppo_epochs` passes over its
    mini-batches of `config.ppo_mini_batch_size` rows, each cut into micro-batches as `micro` says (the role's
    micro-batch size or token budget, as the out-of-memory back-off has it); one optimizer step per mini-batch, the
    gradient clipped at `config.optim.clip_grad` (skipped, with the schedule held, when it is not finite).

    Metrics: the loss-function parts averaged over mini-batches, plus `{role}/grad_norm` (mean of the finite
    norms), `{role}/grad_norm_max`, `{role}/lr` and, for a MoE role with a load-balancing loss,
    `{role}/moe_aux_loss` (`models.moe.moe_aux_loss_metrics`). With routing replay (the experience carries
    `routed_experts`), every forward routes as recorded and `{role}/router_replay_mismatch` is the fraction of
    (token, layer) pairs whose top-k set the live routers would have changed (`models.router_replay`)."""
    rows = experience["input_ids"].shape[0]
    routing = "replay" if model.router_replay is not None and ROUTED_EXPERTS in experience else None
    per_mini_batch: list[Metrics] = []
    update = RoleUpdate()
    mini_batch_size = config.ppo_mini_batch_size
    for _ in range(config.ppo_epochs):
        for start in range(0, rows, mini_batch_size):
            mini = select(experience, range(start, min(start + mini_batch_size, rows)))
            _, _, micro_batches = replica_micro_batches(mini, micro.rows, micro.max_tokens)
            zero_grads(model, optimizer)
            clear_moe_aux_losses()
            outputs = run_micro_batches(
                model, micro_batches, make_loss(mini_batch_counts(mini)), forward_only=False, routing=routing
            )
            moe_metrics = moe_aux_loss_metrics(role, model.config, len(micro_batches))  # already in the backward
            if routing is not None and (mismatch := model.router_replay.take_mismatch()) is not None:
                moe_metrics[f"{role}/router_replay_mismatch"] = mismatch
            result = optimizer_step(optimizer, config.optim.clip_grad)
            if not result.skipped:
                scheduler.step(1)
            update.steps.append(result)
            if outputs:
                per_mini_batch.append(reduce_parts(outputs) | moe_metrics)
    keys = {key for metrics in per_mini_batch for key in metrics}
    update.metrics = broadcast_from_last_stage(
        {key: _mean([m[key] for m in per_mini_batch if key in m]) for key in keys}
    )
    finite = [step.grad_norm for step in update.steps if math.isfinite(step.grad_norm)]
    update.metrics |= {
        f"{role}/grad_norm": _mean(finite),
        f"{role}/grad_norm_max": max(finite, default=float("nan")),
        f"{role}/lr": optimizer.param_groups[0]["lr"],
    }
    return update


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
