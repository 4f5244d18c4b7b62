"""Experience for one PPO iteration: forward passes (no grad) of actor, reference and critic, then token rewards
and advantages. The passes run through the pipeline; their outputs are broadcast from the last stage, so the
experience is the same typed object on every rank."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import NotRequired, TypedDict

import torch

from megatron_ppo import algo
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.data.prepared import column
from megatron_ppo.data.rows import DataError, Row
from megatron_ppo.models import RoleModel, eval_mode, run_micro_batches, vocab_parallel_log_probs
from megatron_ppo.models.packing import labels_of, per_row
from megatron_ppo.models.router_replay import ROUTED_EXPERTS, Action
from megatron_ppo.parallel.collectives import (
    broadcast_tensor_from_last_stage,
    gather_rows_data_parallel,
    is_last_stage,
)
from megatron_ppo.parallel.device import require_on_device
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.batch import Batch, replica_micro_batches
from megatron_ppo.train.micro_batching import MicroBatching, micro_batching
from megatron_ppo.train.profiling import phase


class ForwardPasses(TypedDict):
    """The models' view of a batch of R rows, width W, at label positions (`Batch.loss_mask` marks the response)."""

    old_log_prob: torch.Tensor  # [R, W] log π_old(label): the actor before this iteration's updates
    ref_log_prob: NotRequired[torch.Tensor]  # [R, W] log π_ref(label), when a KL term is on
    values: NotRequired[torch.Tensor]  # [R, W] V(prefix) of the critic, for GAE
    # [R, W, L, K] the old-log-prob pass's experts per input token and layer (R2; `models.router_replay`)
    routed_experts: NotRequired[torch.Tensor]


class Experience(Batch):
    """Everything the actor and critic updates read: the batch, the forward passes, rewards and advantages."""

    old_log_prob: torch.Tensor  # [R, W]
    ref_log_prob: NotRequired[torch.Tensor]  # [R, W]
    values: NotRequired[torch.Tensor]  # [R, W]
    token_level_rewards: torch.Tensor  # [R, W] score (last response token) − β·KL per token when KL is in the reward
    advantages: torch.Tensor  # [R, W] by algorithm.adv_estimator, zero off the response
    returns: torch.Tensor  # [R, W] critic targets
    # [R, W] off-policy importance weights against the behaviour policy (algorithm.rollout_correction.rollout_is)
    rollout_is_weights: NotRequired[torch.Tensor]


def forward_per_token(
    model: RoleModel,
    batch: Batch,
    output_fn: Callable[[Batch, torch.Tensor], torch.Tensor],
    micro: MicroBatching,
    routing: Action | None = None,
    records: dict[str, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`output_fn(micro_batch, model_output)` → `[rows, width]` for every row of `batch`: computed on this
    replica's share, gathered over data-parallel ranks and broadcast from the last pipeline stage (tensor
    collectives on the run's device: `batch` must be there, as `forward_passes` checks). `routing`: the routing
    replay of the pass (R2 records into `records["routed_experts"]`, R3 replays the batch's;
    `models.router_replay`)."""
    share, groups, micro_batches = replica_micro_batches(batch, micro.rows, micro.max_tokens, model.pack_multiple)
    outputs = run_micro_batches(
        model, micro_batches, lambda b, out: (out.new_zeros(()), {"value": output_fn(b, out)}), forward_only=True,
        routing=routing,
    )  # fmt: skip
    if routing == "record":
        assert model.router_replay is not None and records is not None
        records[ROUTED_EXPERTS] = model.router_replay.collect(
            share, groups, len(batch["input_ids"]), batch["input_ids"].shape[1], like=batch["loss_mask"]
        )
    gathered = None
    if is_last_stage():
        width = batch["input_ids"].shape[1]
        per_row: list[torch.Tensor] = [None] * len(share)  # type: ignore[list-item]
        for group, output in zip(groups, outputs, strict=True):
            for position, row in enumerate(group):
                per_row[row] = torch.nn.functional.pad(output["value"][position], (0, width - output["value"].shape[1]))
        gathered = gather_rows_data_parallel(torch.stack(per_row), len(batch["input_ids"]))
    return broadcast_tensor_from_last_stage(gathered, like=batch["loss_mask"])


def log_prob_fn(model: RoleModel) -> Callable[[Batch, torch.Tensor], torch.Tensor]:
    def fn(batch: Batch, logits: torch.Tensor) -> torch.Tensor:
        log_probs = vocab_parallel_log_probs(
            logits, labels_of(batch), vocab_size=model.vocab_size, chunk_tokens=model.logprob_chunk_tokens
        )[0]
        return per_row(batch, log_probs.detach())

    return fn


def values_fn(batch: Batch, output: torch.Tensor) -> torch.Tensor:
    return per_row(batch, output.squeeze(-1).float().detach())


@torch.no_grad()
def forward_passes(
    config: PPOConfig,
    batch: Batch,
    actor: RoleModel,
    ref: RoleModel | None,
    critic: RoleModel | None,
    micro: Mapping[str, MicroBatching] | None = None,
) -> ForwardPasses:
    """`old_log_prob` of the actor, `ref_log_prob` (when a KL term is on) and the critic's `values` (GAE), each
    role in micro-batches of its own size (`log_prob_micro_batch_size_per_gpu`, the critic's
    `forward_micro_batch_size_per_gpu`) or token budget: `micro` (role → its micro-batching, the out-of-memory
    back-off's), by default the config's. With `actor.router_replay.mode` R2 the actor's pass records its routing
    (`routed_experts`); with R3 it routes as the rows' `routed_experts` say."""
    require_on_device(batch, "forward_passes")
    micro = micro_batching(config, Phase.EXPERIENCE) if micro is None else micro
    routing = first_pass_routing(config, batch)
    records: dict[str, torch.Tensor] = {}
    with eval_mode(actor, ref, critic):
        with phase("experience/old_log_prob"):
            old = forward_per_token(actor, batch, log_prob_fn(actor), micro["actor"], routing, records)
        out = ForwardPasses(old_log_prob=old, **records)  # type: ignore[typeddict-item]
        if ref is not None:
            with phase("experience/ref_log_prob"):
                out["ref_log_prob"] = forward_per_token(ref, batch, log_prob_fn(ref), micro["ref"])
        if critic is not None:
            with phase("experience/values"):
                out["values"] = forward_per_token(critic, batch, values_fn, micro["critic"])
    return out


def first_pass_routing(config: PPOConfig, batch: Batch) -> Action | None:
    """What the old-log-prob pass does with the routers: R2 records them, R3 replays the rows' `routed_experts`
    (every row must carry them; `data.parse` checks each against the model)."""
    mode = config.actor.router_replay.mode
    if mode == "R2":
        return "record"
    if mode == "R3":
        if ROUTED_EXPERTS not in batch:
            raise ValueError(
                "actor.router_replay.mode=R3 replays the behaviour policy's routing, but this batch's rows carry no "
                f"'{ROUTED_EXPERTS}': give every row its routed experts, or use mode R2"
            )
        return "replay"
    return None


def compute_advantages(
    config: PPOConfig,
    batch: Batch,
    passes: ForwardPasses,
    reward_kl_coef: float | None,
    normalizer: algo.RunningRewardNormalizer | None,
) -> tuple[Experience, dict[str, float]]:
    """Off-policy correction against the rows' behaviour log-probs (`rollout_correction`: weights, rejected tokens
    leave `loss_mask`), token rewards (clipped/normalised sequence score on the last response token, minus β·KL when
    the KL is in the reward), then the advantages of `algorithm.adv_estimator`; with the reward and `rollout_corr/*`
    metrics. `batch` and `passes` are on the run's device (checked: what enters `algo/` is on one device)."""
    require_on_device({**batch, **passes}, "compute_advantages")
    batch, corrections, metrics = rollout_correction(config, batch, passes)
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
    metrics["reward/mean"] = float(token_scores.sum(-1).mean())
    rewards = token_scores
    if reward_kl_coef is not None:
        kl = algo.kl_penalty(passes["old_log_prob"], passes["ref_log_prob"], config.algorithm.kl_penalty) * mask
        rewards = algo.kl_penalized_rewards(token_scores, kl, reward_kl_coef, mask)
        metrics["kl/reward_penalty"] = float(algo.masked_mean(kl, mask, dim=-1).mean())
    advantages, returns = estimate_advantages(config, rewards, batch, passes)
    experience = Experience(
        **batch, **passes, **corrections, token_level_rewards=rewards, advantages=advantages, returns=returns
    )  # fmt: skip
    return experience, metrics


def estimate_advantages(
    config: PPOConfig, rewards: torch.Tensor, batch: Batch, passes: ForwardPasses
) -> tuple[torch.Tensor, torch.Tensor]:
    """`algorithm.adv_estimator` from the registry (`algo.advantages`), called with verl's keywords."""
    settings = config.algorithm
    values = {"values": passes["values"]} if "values" in passes else {}
    return algo.get_adv_estimator_fn(settings.adv_estimator)(
        token_level_rewards=rewards, response_mask=batch["loss_mask"], index=batch["group"], gamma=settings.gamma,
        lam=settings.lam, norm_adv_by_std_in_grpo=settings.norm_adv_by_std_in_grpo, config=settings, **values,
    )  # fmt: skip


def check_rows_for_rollout_correction(config: PPOConfig, rows: Sequence[Row]) -> None:
    """What `rollout_correction` needs of the rows, checked when they are read (before any model is built): with
    `rollout_is` or `rollout_rs` set, every row carries behaviour log-probs; a `DataError` naming the first that
    does not otherwise."""
    settings = config.algorithm.rollout_correction
    asked = (("rollout_is", settings.rollout_is), ("rollout_rs", settings.rollout_rs))
    which = [f"{key}={value}" for key, value in asked if value is not None]
    if not which:
        return
    lacking = [i for i, given in enumerate(column(rows, "has_behavior_log_probs")) if not given]
    if lacking:
        raise DataError(
            f"{rows[lacking[0]].source}: the row has no 'behavior_log_probs' ({len(lacking)} of {len(rows)} rows lack "
            "them), "
            f"but algorithm.rollout_correction.{' and '.join(which)} weighs or rejects tokens by the behaviour "
            "policy's log-probs: give every row a 'behavior_log_probs' column (one log-prob per response token), "
            "or unset algorithm.rollout_correction.rollout_is / rollout_rs"
        )


def rollout_correction(
    config: PPOConfig, batch: Batch, passes: ForwardPasses
) -> tuple[Batch, dict[str, torch.Tensor], dict[str, float]]:
    """With behaviour log-probs μ in the rows: verl's correction of π_old (`old_log_prob`) against μ over the whole
    batch — the `rollout_corr/*` diagnostics always, importance weights (`rollout_is`) and rejected tokens
    (`rollout_rs`, removed from `loss_mask`) when set. The diagnostics cover the rows that carry behaviour log-probs;
    weights and rejection need them on every row. Returns (batch, {"rollout_is_weights": …} or {}, metrics)."""
    settings = config.algorithm.rollout_correction
    applies = settings.rollout_is is not None or settings.rollout_rs is not None
    rows_with = batch["behavior_rows"] if "behavior_log_prob" in batch else torch.zeros(0, dtype=torch.bool)
    if applies and not (len(rows_with) and bool(rows_with.all())):
        missing = len(batch["loss_mask"]) - int(rows_with.sum())
        raise ValueError(f"algorithm.rollout_correction.rollout_is / rollout_rs weigh or reject tokens by the "
                         f"behaviour policy's log-probs, but {missing} of this batch's {len(batch['loss_mask'])} rows "
                         "carry none: give every row a 'behavior_log_probs' column (one log-prob per response "
                         "token), or unset both")  # fmt: skip
    if not bool(rows_with.any()):
        return batch, {}, {}
    mask = batch["loss_mask"] * rows_with[:, None]  # diagnostics over the rows that carry behaviour log-probs
    log_ratio = passes["old_log_prob"] - batch["behavior_log_prob"]
    weights, kept, metrics = algo.compute_rollout_correction_and_rejection_mask(
        passes["old_log_prob"], batch["behavior_log_prob"], mask, rollout_is=settings.rollout_is,
        rollout_is_threshold=settings.rollout_is_threshold,
        rollout_is_batch_normalize=settings.rollout_is_batch_normalize, rollout_rs=settings.rollout_rs,
        rollout_rs_threshold=settings.rollout_rs_threshold,
    )  # fmt: skip
    if weights is None:  # the weights' diagnostics (ESS) still say how far the rows are from the actor
        _, would_be = algo.compute_rollout_correction_weights(log_ratio, mask, "token", settings.rollout_is_threshold)
        metrics |= {f"rollout_corr/{key}": value for key, value in would_be.items()}
    if settings.rollout_rs is not None:
        batch = Batch(**{**batch, "loss_mask": kept})
    return batch, ({} if weights is None else {"rollout_is_weights": weights}), metrics


def experience_metrics(config: PPOConfig, experience: Experience) -> dict[str, float]:
    """Response length; KL(actor‖ref) per token over sequences: mean, std and the mean's standard error
    (std/√sequences; the estimator of the KL loss, else of the reward penalty); GRPO groups of one row in the batch;
    the critic's mean value and explained variance of the returns."""
    mask = experience["loss_mask"]
    out = {"response_length/mean": float(mask.sum(-1).mean())}
    if "ref_log_prob" in experience:
        out |= kl_summary(config, experience["old_log_prob"], experience["ref_log_prob"], mask, "kl/")
    if config.algorithm.adv_estimator in algo.GROUPED_ESTIMATORS:
        out["grpo/singleton_groups"] = float((torch.bincount(experience["group"]) == 1).sum())
    if "values" in experience:
        out["critic/values_mean"] = float(algo.masked_mean(experience["values"], mask))
        out["critic/vf_explained_var"] = float(
            algo.explained_variance(experience["values"], experience["returns"], mask)
        )
    return out


def kl_summary(
    config: PPOConfig, log_prob: torch.Tensor, ref_log_prob: torch.Tensor, mask: torch.Tensor, prefix: str
) -> dict[str, float]:
    """KL(actor‖ref) per token over sequences (each sequence's token mean, the estimator of the KL loss, else of the
    reward penalty): `<prefix>mean`, `<prefix>std` and the mean's standard error `<prefix>stderr` = std/√sequences."""
    kind = config.actor.kl_loss_type if config.actor.use_kl_loss else config.algorithm.kl_penalty
    per_sequence = algo.masked_mean(algo.kl_penalty(log_prob, ref_log_prob, kind), mask, dim=-1)
    mean, std = torch.stack([per_sequence.mean(), per_sequence.std()]).tolist()  # one read of the device
    stderr = std / math.sqrt(per_sequence.numel())
    return {f"{prefix}mean": mean, f"{prefix}std": std, f"{prefix}stderr": stderr}


def _clip_range(config: PPOConfig) -> tuple[float, float] | None:
    clip = config.reward.clip_range
    return None if clip is None else (clip[0], clip[1])
