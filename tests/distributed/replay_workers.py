"""Code that runs inside the spawned ranks of the routing-replay tests (`models.router_replay`): the trainer's own
experience pass (R2 records) and actor update (replays), on a tiny MoE model, at a layout."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay

from megatron_ppo.config.schema import MegatronConfig, RouterReplaySettings
from megatron_ppo.models import build_role_model, unwrap, vocab_parallel_log_probs
from megatron_ppo.models.packing import labels_of, per_row
from megatron_ppo.models.router_replay import ROUTED_EXPERTS
from megatron_ppo.parallel import init_distributed
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.batch import collate
from megatron_ppo.train.experience import forward_passes
from megatron_ppo.train.micro_batching import MicroBatching, micro_batching
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from megatron_ppo.train.update import MetricPart, actor_loss, update_role
from tests.distributed import workers

MOE_MODEL = dataclasses.replace(
    workers.MODEL, name="replay-moe", num_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
)  # fmt: skip


def _config(layout: MegatronConfig, mode: str, epochs: int):
    config = workers.ppo_config(layout, MOE_MODEL)
    config.actor.router_replay = RouterReplaySettings(mode=mode)
    config.actor.ppo_epochs = epochs
    config.actor.log_prob_micro_batch_size_per_gpu = 4  # the experience pass cuts rows unlike the update (2)
    return config


def _routers(model) -> list[RouterReplay]:
    return [m.router_replay for c in model.chunks for m in unwrap(c).modules()
            if isinstance(m, TopKRouter) and m.router_replay is not None]  # fmt: skip


def _checked_loss(config, counts):
    """The actor's loss, with the largest |log π_θ − log π_old| over the response tokens of the micro-batch."""
    loss_fn = actor_loss(config, counts, kl_loss_coef=0.1, vocab_size=MOE_MODEL.vocab_size)

    def fn(batch, logits):
        log_prob, _ = vocab_parallel_log_probs(logits, labels_of(batch), vocab_size=MOE_MODEL.vocab_size)
        gap = ((per_row(batch, log_prob.detach()) - batch["old_log_prob"]).abs() * batch["loss_mask"]).max()
        loss, parts = loss_fn(batch, logits)
        return loss, parts | {"actor/old_gap": MetricPart(gap, 1.0, "max")}

    return fn


def replay_run(rank: int, world_size: int, workdir: str, layout: MegatronConfig, save: bool = False,
               packed: bool = False) -> dict[str, Any]:  # fmt: skip
    """At `layout`: the experience pass with R2 (the ref built with replay too, before the actor, so Megatron's
    global list of replay instances starts with the ref's), then two PPO epochs of the actor replaying, then the
    same update again under full recompute. `save`: write the initial weights (the EP 1 reference). `packed`: the
    same experience and update again with packed sequences, each pass packing the rows by its own token budget
    (on one process under full recompute)."""
    workdir = Path(workdir)
    started = time.perf_counter()
    init_distributed(layout, seed=workers.SEED)
    ref = build_role_model("ref", MOE_MODEL, layout, routing_replay=True)  # a neighbour on the global list
    actor = build_role_model("actor", MOE_MODEL, layout, routing_replay=True)
    if save:
        workers.save(actor, workdir / "initial")
    workers.load(actor, workdir / "initial")
    workers.load(ref, workdir / "initial")
    config = _config(layout, "R2", epochs=2)
    batch = workers.experience(workers.ROWS, seed=3)
    passes = forward_passes(config, batch, actor, ref, None)
    ref_replays = _routers(ref)
    ref_untouched = all(r.router_replay_action is None and r.recorded_topk_idx is None and r.target_topk_idx is None
                        for r in ref_replays)  # fmt: skip
    exp = workers.experience(workers.ROWS, seed=3, passes=dict(passes))
    r3 = {} if world_size > 1 else _r3_first_pass(layout, actor, passes)
    runs = {"plain": _update_twice(actor, layout, config, exp)}
    recompute = dataclasses.replace(layout, recompute_granularity="full", recompute_method="uniform",
                                    recompute_num_layers=1)  # fmt: skip
    if world_size == 1:  # full recompute: the same update
        again = build_role_model("actor", MOE_MODEL, recompute, routing_replay=True)
        workers.load(again, workdir / "initial")
        runs["recompute"] = _update_twice(again, recompute, config, exp)
    packed_passes = {}
    if packed:
        packed_layout = recompute if world_size == 1 else layout
        packed_passes, runs["packed"] = _packed_record_and_replay(packed_layout, config, batch, passes, workdir)
    # the live routing of the updated weights, recorded: how far replay held the routers
    real = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["lengths"][:, None]
    changed = torch.tensor(float("nan"))
    if world_size == 1:
        drifted = forward_passes(config, batch, actor, None, None)[ROUTED_EXPERTS]
        changed = (drifted.sort(-1).values != passes[ROUTED_EXPERTS].sort(-1).values).any(-1)[real].float().mean()
    return {
        "passes": {k: v.clone() for k, v in passes.items()},
        "real": real,
        "ref_untouched": ref_untouched and all(r.target_topk_idx is None for r in ref_replays),
        "global_instances": len(RouterReplay.global_router_replay_instances),
        "actor_instances": len(actor.router_replay.routers),
        "ref_instances": len(ref_replays),
        "runs": runs,
        "drift_after_update": float(changed),
        "seconds": time.perf_counter() - started,
        "r3": r3,
        "packed_passes": packed_passes,
    }


# the packed passes' token budgets: rows hold 4–13 tokens (14 once padded to 2 for TP 2 + SP), so the experience's
# packs (≤ 21 tokens) and the update's (≤ 14) group the rows unlike each other and unlike the padded passes' row
# counts (4 and 2)
PACKED_BUDGETS = {"experience": 21, "update": 14}


def _packed_record_and_replay(layout: MegatronConfig, config, batch, passes, workdir: Path) -> tuple[dict, dict]:
    """The padded run's experience and update with a packed actor (`model.pack_sequences`, the same weights): its
    R2 record and old log-probs, and its two replayed update epochs (`_update_twice`)."""
    actor = build_role_model("actor", dataclasses.replace(MOE_MODEL, pack_sequences=True), layout,
                             routing_replay=True)  # fmt: skip
    workers.load(actor, workdir / "initial")
    ours = forward_passes(
        config, batch, actor, None, None, {"actor": MicroBatching(max_tokens=PACKED_BUDGETS["experience"])}
    )
    exp = workers.experience(workers.ROWS, seed=3, passes={**passes, **ours})  # the padded run's ref log-probs
    update = _update_twice(actor, layout, config, exp, MicroBatching(max_tokens=PACKED_BUDGETS["update"]))
    return {**{k: v.clone() for k, v in ours.items()}, "notes": sorted(actor.pass_notes)}, update


def _update_twice(actor, layout: MegatronConfig, config, exp, micro: MicroBatching | None = None) -> dict[str, Any]:
    """Two epochs (one `update_role` each, one optimizer step each) replaying `exp`'s routes, in micro-batches of
    `micro` (default: the config's): per epoch the largest |log π_θ − log π_old|, the mismatch, pg_loss and grad
    norm; the router weights' gradient norms; how many targets each pass left in Megatron's backward queues."""
    router_grads: list[float] = []
    for router in (m for c in actor.chunks for m in unwrap(c).modules() if isinstance(m, TopKRouter)):
        router.weight.register_hook(lambda g: router_grads.append(float(g.norm())))
    left_in_queues: list[list[int]] = []
    end_pass = actor.router_replay.end_pass

    def counted_end_pass() -> None:
        left_in_queues.append([len(r.replay_backward_list) for _, r in actor.router_replay.routers])
        end_pass()

    actor.router_replay.end_pass = counted_end_pass
    optimizer = build_optimizer(actor, workers.OPTIM, layout)
    scheduler = build_scheduler(optimizer, workers.OPTIM, total_steps=2)
    epochs = []
    for _ in range(2):
        update = update_role(
            "actor", actor, optimizer, scheduler, exp, config=dataclasses.replace(config.actor, ppo_epochs=1),
            micro=micro or micro_batching(config, Phase.update("actor"))["actor"],
            make_loss=partial(_checked_loss, config.actor),
        )  # fmt: skip
        epochs.append({key: update.metrics.get(f"actor/{key}")
                       for key in ("old_gap", "router_replay_mismatch", "pg_loss", "grad_norm")})  # fmt: skip
    return {"epochs": epochs, "router_grads": router_grads, "left": list(left_in_queues)}


def _r3_first_pass(layout: MegatronConfig, actor, passes) -> dict[str, float]:
    """R3 from rows: the rows carry the R2 record as `routed_experts` (through `collate`), so the R3 first pass
    must give R2's log-probs; with every route moved to the next expert, other log-probs."""
    config = _config(layout, "R3", epochs=1)
    records = passes[ROUTED_EXPERTS].long() - 1
    out = {}
    for name, shift in (("same", 0), ("moved", 1)):
        rows = [dataclasses.replace(row, routed_experts=((records[i, : row_length(row)] + shift) % 4).int())
                for i, row in enumerate(workers.rows(workers.ROWS, seed=3))]  # fmt: skip
        batch = collate(rows, pad_id=0)
        old = forward_passes(config, batch, actor, None, None)["old_log_prob"]
        out[name] = float(((old - passes["old_log_prob"]).abs() * batch["loss_mask"]).max())
    return out


def row_length(row) -> int:
    return len(row.prompt_ids) + len(row.response_ids)
