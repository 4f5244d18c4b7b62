"""Spawned-rank code for the context-parallel bookkeeping tests (one gloo process: Megatron's parallel state and
collectives are real, the CP ranks are simulated by splitting the same rows as each rank would)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel.schedules import forward_step_calc_loss
from megatron.core.transformer import TransformerConfig

from megatron_ppo.algo import LOSS_AGGREGATIONS
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models import vocab_parallel_log_probs
from megatron_ppo.models.context_parallel import merge_chunks, split_micro_batch
from megatron_ppo.models.schedule import _scaled_loss
from megatron_ppo.parallel import init_distributed
from megatron_ppo.parallel.megatron_compat import get_batch_on_this_cp_rank
from megatron_ppo.train.batch import select
from megatron_ppo.train.update import actor_loss, critic_loss, mini_batch_counts
from tests.distributed.workers import MODEL, experience, ppo_config

CP = 2
MICRO_BATCHES = 2
# Megatron DDP's gradient_scaling_factor without per-token loss: 1 / |DP×CP group| (distributed_data_parallel.py,
# "Case 2"; "Case 1" averages in the collective to the same effect); the gradients are then summed over that group.
DP = 1


def split_agrees_with_megatron(rank: int, world_size: int) -> list[str]:
    """Our split of a micro-batch whose width divides into 2·CP chunks against Megatron's, for CP 2 and 4: four
    gloo ranks, real CP groups of 2 ({0, 1}, {2, 3}) and of 4, each rank checking its own chunk."""
    init_distributed(MegatronConfig(), seed=0)
    groups = {2: [torch.distributed.new_group(ranks) for ranks in ([0, 1], [2, 3])][rank // 2],
              4: torch.distributed.group.WORLD}  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    problems = []
    for cp, cp_group in groups.items():
        batch = {"input_ids": torch.randint(0, 100, (3, 8 * cp), generator=generator),
                 "loss_mask": torch.rand(3, 8 * cp, generator=generator),
                 "logits": torch.randn(3, 8 * cp, 5, generator=generator)}  # fmt: skip
        cp_rank = torch.distributed.get_rank(cp_group)
        ours = split_micro_batch(batch, cp, cp_rank)
        theirs = get_batch_on_this_cp_rank({k: v.clone() for k, v in batch.items()}, cp_group=cp_group)
        problems += [f"CP {cp} rank {cp_rank}: {key}" for key in batch if not torch.equal(ours[key], theirs[key])]
    return problems


def _loss_and_grad(make_loss, rows, output: torch.Tensor, cp: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The gradient DDP would hold for `output` after every micro-batch of `rows` ran on every CP rank through
    our `_scaled_loss` and Megatron's `forward_step_calc_loss` (× CP, ÷ micro-batches), then DDP's scaling
    1 / (DP·CP) and sum; and the loss metrics combined as `reduce_parts` does (sums; token means)."""
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    output.grad = None
    loss_fn = make_loss(mini_batch_counts(rows))
    count = rows["input_ids"].shape[0]
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    means: set[str] = set()
    for start in range(0, count, count // MICRO_BATCHES):
        index = range(start, start + count // MICRO_BATCHES)
        for cp_rank in range(cp):  # each rank's own graph from the shared output
            micro = select(rows, index) | {"output": output[list(index), : int(rows["lengths"][list(index)].max())]}
            local = split_micro_batch(micro, cp, cp_rank) if cp > 1 else micro
            store: list[Any] = []
            seeded, _ = forward_step_calc_loss(
                None, local["output"], partial(_scaled_loss, loss_fn, local, MICRO_BATCHES), config, None, False,
                MICRO_BATCHES, store, cp_group_size=cp, is_last_stage=True,
            )  # fmt: skip
            seeded.backward()
            for key, part in store[0].items():
                sums[key] = sums.get(key, 0.0) + part.value
                weights[key] = weights.get(key, 0.0) + part.weight
                if part.reduce == "mean":
                    means.add(key)
    metrics = {k: v / weights[k] if k in means else v for k, v in sums.items()}
    return output.grad / (DP * cp), metrics


def loss_scale_against_cp1(rank: int, world_size: int) -> dict[str, Any]:
    """For every loss_agg_mode, actor and critic: the gradient of the model output and the loss metrics with the
    rows split over CP = 2 ranks, against CP = 1 on the same rows; and the log-probs of the experience pass,
    computed per rank on its chunks and merged back, against those of the whole rows."""
    init_distributed(MegatronConfig(), seed=0)
    rows = experience(8, seed=5)
    shape = rows["input_ids"].shape
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(*shape, MODEL.vocab_size, generator=generator).requires_grad_()
    values = torch.randn(*shape, 1, generator=generator).requires_grad_()
    report: dict[str, Any] = {}
    for mode in LOSS_AGGREGATIONS:
        config = ppo_config(MegatronConfig())
        config.actor.loss_agg_mode = config.critic.loss_agg_mode = mode
        config.actor.entropy_coeff = 0.01
        for role, make_loss, output in (
            ("actor", partial(actor_loss, config.actor, kl_loss_coef=0.1, vocab_size=MODEL.vocab_size), logits),
            ("critic", partial(critic_loss, config.critic), values),
        ):
            grad_1, metrics_1 = _loss_and_grad(make_loss, rows, output, cp=1)
            grad_cp, metrics_cp = _loss_and_grad(make_loss, rows, output, cp=CP)
            report[f"{role} {mode}"] = {
                "grad": float((grad_cp - grad_1).abs().max() / grad_1.abs().max()),
                "metrics": {k: abs(metrics_cp[k] - v) for k, v in metrics_1.items()},
            }
    full = vocab_parallel_log_probs(logits.detach(), rows["labels"], vocab_size=MODEL.vocab_size)[0]
    parts = []
    for cp_rank in range(CP):
        local = split_micro_batch({"input_ids": rows["input_ids"], "labels": rows["labels"], "logits": logits.detach()},
                                  CP, cp_rank)  # fmt: skip
        parts.append(vocab_parallel_log_probs(local["logits"], local["labels"], vocab_size=MODEL.vocab_size)[0])
    report["merged log-probs"] = float((merge_chunks(parts, shape[1]) - full).abs().max())
    return report
