"""Spawned-rank code for the data-parallel overlap tests: DP 2, the distributed optimizer, gradient reduce and
parameter all-gather overlapped (Megatron's asynchronous path over gloo)."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_ppo.checkpoint import store
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models import build_role_model, unwrap
from megatron_ppo.parallel import init_distributed
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.memory_backoff import OutOfMemoryBackoff
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from megatron_ppo.train.update import actor_loss, update_role
from tests.distributed.workers import MODEL, OPTIM, ROWS, SEED, experience, ppo_config, weights

LAYOUT = MegatronConfig(use_distributed_optimizer=True)


def _arm_out_of_memory(actor, micro_batches: int) -> dict[str, int]:
    """Raise `torch.OutOfMemoryError` once, in the backward of the `micro_batches`-th micro-batch (the last one of
    the first mini-batch), half-way down the network: the output layer's gradients are already in the buckets."""
    calls = {"n": 0, "raised": 0}
    weight = unwrap(actor.chunks[0]).decoder.layers[1].self_attention.linear_qkv.weight

    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == micro_batches and not calls["raised"]:
            calls["raised"] = 1
            raise torch.OutOfMemoryError("injected: out of memory in the last micro-batch's backward")
        return grad

    weight.register_hook(hook)
    return calls


def _update(config, actor, optimizer, backoff: OutOfMemoryBackoff):
    scheduler = build_scheduler(optimizer, OPTIM, total_steps=1)
    batch = experience(ROWS, seed=3)
    make_loss = partial(actor_loss, config.actor, kl_loss_coef=0.1, vocab_size=MODEL.vocab_size)

    def attempt():
        micro = backoff.micro_batching(Phase.UPDATE_ACTOR)["actor"]
        return update_role("actor", actor, optimizer, scheduler, batch, config=config.actor, micro=micro,
                           make_loss=make_loss)  # fmt: skip

    return backoff.run(Phase.UPDATE_ACTOR, attempt, lambda: None, print)


def overlapped_update(rank: int, world_size: int, workdir: str, inject: bool) -> dict[str, Any]:
    """One actor update at DP 2 from the parity reference's initial weights: with an out-of-memory error injected
    in the last micro-batch's backward (retried by the back-off with one row fewer), or without one at the
    retry's micro-batch size. Then the checkpoint save, read back."""
    from tests.distributed.workers import load

    workdir = Path(workdir)
    init_distributed(LAYOUT, seed=SEED)
    config = ppo_config(LAYOUT)
    actor = build_role_model("actor", MODEL, LAYOUT)
    load(actor, workdir / "initial" / "actor")
    optimizer = build_optimizer(actor, OPTIM, LAYOUT)
    ddp = actor.chunks[0]
    report: dict[str, Any] = {"overlap": (ddp.ddp_config.overlap_grad_reduce, ddp.use_forward_hook)}
    if inject:
        calls = _arm_out_of_memory(actor, micro_batches=ROWS // 2 // world_size)
        backoff = OutOfMemoryBackoff(config)
        update = _update(config, actor, optimizer, backoff)
        report |= {"raised": calls["raised"], "retries": backoff.retries, "overrides": backoff.overrides}
    else:
        smaller = config.actor.ppo_micro_batch_size_per_gpu - 1  # the size the back-off retries with
        update = _update(
            config,
            actor,
            optimizer,
            OutOfMemoryBackoff(with_changes(config, {"actor.ppo_micro_batch_size_per_gpu": smaller})),
        )
    report["grad_norm"] = update.steps[0].grad_norm
    before_sync = weights(actor)  # the distributed optimizer's all-gather of the new weights is still pending
    saved = store.save_checkpoint(workdir / f"ckpt-{inject}", 1, {"actor": actor}, {}, {"step": 1})
    after_sync = weights(actor)
    report["stale_before_sync"] = any(not torch.equal(v, after_sync[k]) for k, v in before_sync.items())
    fresh = build_role_model("actor", MODEL, LAYOUT)
    store.load_weights(fresh, saved, "actor")
    report["saved_equals_synced"] = all(torch.equal(v, after_sync[k]) for k, v in weights(fresh).items())
    report["weights"] = str(workdir / f"weights-{inject}-rank{rank}.pt")  # tensors do not outlive the rank's queue
    torch.save(after_sync, report["weights"])
    return report
