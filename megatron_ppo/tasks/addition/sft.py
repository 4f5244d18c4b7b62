"""Supervised fine-tuning on (prompt, response) rows: the tiny recipe's initial policy, trained on the demonstrator."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megatron_ppo import algo
from megatron_ppo.data.batching import EpochSampler
from megatron_ppo.data.rows import Row
from megatron_ppo.models import RoleModel, run_micro_batches, vocab_parallel_log_probs
from megatron_ppo.models.packing import labels_of, per_row
from megatron_ppo.parallel.collectives import broadcast_from_last_stage
from megatron_ppo.parallel.ranks import data_parallel
from megatron_ppo.train.batch import collate, replica_micro_batches
from megatron_ppo.train.optimizer import optimizer_step, zero_grads


def sft_loss(vocab_size: int, dp_size: int, num_tokens: float):
    """−(1/N) Σ log π(response token), N = response tokens in the whole step (all micro-batches and replicas)."""

    def loss_fn(batch, logits):
        log_prob, _ = vocab_parallel_log_probs(logits, labels_of(batch), vocab_size=vocab_size)
        log_prob = per_row(batch, log_prob)  # packed (model.pack_sequences): back to the rows
        loss = algo.agg_loss(-log_prob, batch["loss_mask"], "token-mean", dp_size=dp_size, batch_num_tokens=num_tokens)
        # tensors: a Python number here would synchronise the device once per micro-batch
        return loss, {"nll_sum": (-log_prob.detach() * batch["loss_mask"]).sum(), "tokens": batch["loss_mask"].sum()}

    return loss_fn


def run_sft(
    actor: RoleModel,
    optimizer,
    scheduler,
    rows: Sequence[Row],
    *,
    steps: int,
    batch_size: int,
    micro_batch_size: int,
    clip_grad: float,
    pad_id: int,
    seed: int,
    on_step: Callable[[int, float], None] | None = None,
) -> float:
    """`steps` optimizer steps of next-token NLL on the responses; returns the last step's mean NLL per token."""
    sampler = EpochSampler(len(rows), seed=seed)
    dp_size = data_parallel().size
    nll = float("nan")
    for step in range(steps):
        batch = collate([rows[i] for i in sampler.next_batch(batch_size)], pad_id)
        _, _, micro = replica_micro_batches(batch, micro_batch_size)
        zero_grads(actor, optimizer)
        outputs = run_micro_batches(
            actor, micro, sft_loss(actor.vocab_size, dp_size, float(batch["loss_mask"].sum())), forward_only=False
        )
        if not optimizer_step(optimizer, clip_grad).skipped:  # a skipped step holds the schedule, as in PPO
            scheduler.step(1)
        if outputs:  # one transfer to the host per step
            nll_sum, tokens = torch.stack([torch.stack((o["nll_sum"], o["tokens"])) for o in outputs]).double().sum(0)
            nll = float(nll_sum / tokens.clamp(min=1.0))
        nll = broadcast_from_last_stage(nll)
        if on_step is not None:
            on_step(step, nll)
    return nll
