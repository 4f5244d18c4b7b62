"""Spawned-rank code for the asynchronous-save tests (`test_async_save.py`); `python -m` of this module is the job
the SIGKILL test kills."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from megatron_ppo.checkpoint import directory, store
from megatron_ppo.checkpoint.async_save import AsyncSaves
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import MegatronConfig, TrainerConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.models.gpt import sync_parameters
from megatron_ppo.parallel import init_distributed
from megatron_ppo.parallel.collectives import barrier
from megatron_ppo.parallel.cpu_compat import without_device_mode
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from tests.distributed.checkpoint_workers import RUN, _one_update
from tests.distributed.workers import MODEL, OPTIM, ROWS, SEED, ppo_config, weights

LAYOUT = MegatronConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True)


def slow_writes(seconds: float) -> None:
    """A slow file system: each rank's forked writer sleeps `seconds` after writing its shards, before it exits
    (the finalisation cannot start before). Wraps Megatron's write function in the request `store` schedules."""
    original = store.async_save_request

    def slowed(*args: Any, **kwargs: Any) -> Any:
        request = original(*args, **kwargs)

        def write_then_sleep(*args: Any, **kwargs: Any) -> None:
            request.async_fn(*args, **kwargs)
            time.sleep(seconds)

        return request._replace(async_fn=write_then_sleep)

    store.async_save_request = slowed


def _build(layout: MegatronConfig):
    optim = dataclasses.replace(OPTIM, lr=1e-2, weight_decay=0.1, adam_eps=1e-8, lr_decay_style="constant")
    actor = build_role_model("actor", MODEL, layout)
    optimizer = build_optimizer(actor, optim, layout)
    return actor, optimizer, build_scheduler(optimizer, optim, total_steps=10)


def async_save_resumes_like_a_sync_save(rank: int, world_size: int, root: str, write_s: float) -> dict[str, Any]:
    """Saves sharing one `SavePlans`: one before any update (no optimizer state: another structure), then after
    two updates two synchronous ones (the strategy's first, validated, and second, its plan checked unchanged) and
    an asynchronous one whose write takes ≥ `write_s` (slowed; the strategy's third: each rank reuses its cached
    plan, rank 0 the global metadata); a third update while the asynchronous write is under way; then the
    asynchronous checkpoint is finalised, and fresh models load the first synchronous checkpoint and the
    asynchronous one and take the third update again."""
    root = Path(root)
    init_distributed(LAYOUT, seed=SEED)
    config = with_changes(ppo_config(LAYOUT), {"actor.ppo_mini_batch_size": ROWS // 2})
    actor, optimizer, scheduler = _build(LAYOUT)
    plans, validated = store.SavePlans(), []
    for_save = plans.for_save

    def recorded(sharded: dict[str, Any]) -> tuple[Any, bool]:
        strategy, validate = for_save(sharded)
        validated.append(validate)
        return strategy, validate

    plans.for_save = recorded
    save = functools.partial(store.save_checkpoint, models={"actor": actor}, optimizers={"actor": optimizer},
                             run=RUN, plans=plans)  # fmt: skip
    save(root / "fresh", 0, trainer_state={"step": 0})
    for seed in (1, 2):
        _one_update(actor, optimizer, scheduler, config, seed)
    started = time.perf_counter()
    save(root / "sync", 2, trainer_state={"step": 2})
    sync_s = time.perf_counter() - started
    save(root / "again", 2, trainer_state={"step": 2})
    slow_writes(write_s)
    saves = AsyncSaves()
    started = time.perf_counter()
    pending = save(root / "async", 2, trainer_state={"step": 2}, saves=saves)
    returned_s = time.perf_counter() - started
    writing = saves.queue.async_calls[0].async_caller.process.is_alive()  # this rank's writer, on return
    saves.returned(returned_s)
    # training goes on while the write runs: the checkpoint must still hold the weights of step 2
    uninterrupted = _one_update(actor, optimizer, scheduler, config, seed=3)
    sync_parameters(actor)
    expected = weights(actor)
    while_pending = {"published": pending.exists(), "latest": directory.named_by_latest(root / "async"),
                     "poll": saves.poll()}  # fmt: skip
    barrier()
    timing = saves.wait()
    resumed = {}
    for kind in ("async", "sync"):
        actor, optimizer, scheduler = _build(LAYOUT)
        store.load_checkpoint(root / kind / "step_2", {"actor": actor}, {"actor": optimizer})
        update = _one_update(actor, optimizer, scheduler, config, seed=3)
        sync_parameters(actor)
        after = weights(actor)
        resumed[kind] = (update, max((after[k] - expected[k]).abs().max().item() for k in expected))
    return {"returned_s": returned_s, "writing_on_return": writing, "sync_s": sync_s, "while_pending": while_pending,
            "timing": timing, "latest": directory.named_by_latest(root / "async"), "uninterrupted": uninterrupted,
            "resumed": resumed, "validated": validated, "failures": failed_writes(root, actor, optimizer)}  # fmt: skip


def failed_writes(root: Path, actor: Any, optimizer: Any) -> dict[str, Any]:
    """Step 3 saved again into both roots, failing on one rank only: asynchronously, rank 1's writer finds the
    name of its first shard file taken by a directory (Megatron's writer thread fails to open it); synchronously,
    rank 0's manifest finds its temporary name taken. Each rank's error (None: none raised), whether the partial
    save is gone, and what `latest` names after it."""
    original = store.async_save_request

    def shard_name_taken(*args: Any, **kwargs: Any) -> Any:
        request = original(*args, **kwargs)
        if torch.distributed.get_rank() != 1:
            return request

        def obstructed(*write_args: Any, **write_kwargs: Any) -> None:
            os.mkdir(write_args[1][0][0])  # the first write bucket's file name
            request.async_fn(*write_args, **write_kwargs)

        return request._replace(async_fn=obstructed)

    manifest = store.verify.write_manifest

    def manifest_name_taken(checkpoint: Path) -> None:
        (checkpoint / f".{store.verify.MANIFEST}.tmp").mkdir()
        manifest(checkpoint)

    outcome = {}
    for kind in ("async", "sync"):
        saves = AsyncSaves() if kind == "async" else None
        store.async_save_request, store.verify.write_manifest = shard_name_taken, manifest_name_taken
        error = None
        try:
            store.save_checkpoint(root / kind, 3, {"actor": actor}, {"actor": optimizer}, {"step": 3}, run=RUN,
                                  saves=saves)  # fmt: skip
            if saves is not None:
                saves.wait()
        except store.verify.CheckpointError as raised:
            error = str(raised)
        finally:
            store.async_save_request, store.verify.write_manifest = original, manifest
        outcome[kind] = (error, (root / kind / ".tmp_step_3").exists(), directory.named_by_latest(root / kind))
    return outcome


def keeper_waits_for_pending_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A keeper saving asynchronously (slowed writes, keep=2): the next save, a rollback's target, a stop and
    pruning each meet a pending save."""
    root = Path(root)
    init_distributed(MegatronConfig(), seed=SEED)
    actor, optimizer, _ = _build(MegatronConfig())
    models, optimizers = {"actor": actor}, {"actor": optimizer}
    trainer = TrainerConfig(default_local_dir=str(root), max_ckpt_to_keep=2, async_save=True)
    keeper = CheckpointKeeper(trainer, RUN)
    slow_writes(0.5)
    report: dict[str, Any] = {}
    for step in (1, 2):
        keeper.save(step, models, optimizers, {"step": step, **keeper.state_dict()})
        keeper.judge(step + 1, [])  # each save passes the next iteration's guards: good
    # step 2 is pending and unconfirmed-then-good; step 3's save must first publish it
    keeper.save(3, models, optimizers, {"step": 3, **keeper.state_dict()})
    report["pending_after_save_3"] = keeper.saves.pending.step
    report["published_before_save_3"] = sorted(p.name for _, p in directory.step_directories(root))
    report["marked_before_save_3"] = sorted(p.name for _, p in directory.step_directories(root)
                                            if directory.judged_good(p))  # fmt: skip
    keeper.judge(4, [])
    # step 3 is pending: the good checkpoint (step 3) is loaded by a rollback only once published
    target = keeper.rollback_target("latest")
    report["rollback_target"] = (target.path.name if target.path else None, keeper.saves.pending)
    keeper.save(4, models, optimizers, {"step": 4, **keeper.state_dict()})
    keeper.save(
        5, models, optimizers, {"step": 5, **keeper.state_dict()}
    )  # step 4 published: prune (keep 2) while 5 is pending
    report["while_5_pending"] = sorted(p.name for p in root.iterdir() if "step" in p.name and not _set_aside(p))
    report["resumable_while_5_pending"] = directory.find_resumable(root).name
    keeper.judge(6, [])
    report["stop"] = keeper.leave_for_stop()
    report["after_stop"] = (sorted(p.name for _, p in directory.step_directories(root)),
                            directory.named_by_latest(root).name, keeper.saves.pending)  # fmt: skip
    # step 5's writer deleted what step 4's publication pruned; step 5's publication set step 3 aside, undeleted
    report["set_aside_after_stop"] = sorted(_set_aside(p) for p in root.iterdir() if _set_aside(p))
    keeper.save(6, models, optimizers, {"step": 6, **keeper.state_dict()})
    keeper.close()  # the trainer's close, step 6 still being written: every rank (the one) agrees to publish it
    report["after_close"] = (directory.named_by_latest(root).name, keeper.saves.pending)
    report["set_aside_after_close"] = sorted(p.name for p in root.iterdir() if _set_aside(p))
    # a new process's keeper: step 5 was judged good (by step 6's guards) and marked; step 6 never judged
    report["marked"] = sorted(p.name for _, p in directory.step_directories(root) if directory.judged_good(p))
    resumed = {}
    for name in ("step_5", "step_6"):
        again = CheckpointKeeper(trainer, RUN)
        again.resume(root / name, models, optimizers)
        resumed[name] = (again.good and Path(again.good).name, again.unconfirmed and Path(again.unconfirmed).name)
    report["resumed"] = resumed
    return report


def _set_aside(path: Path) -> str | None:
    """The name of the checkpoint `path` holds when it was set aside for deletion (`.discarded_step_N.<id>`)."""
    if not path.name.startswith(directory.DISCARDED_PREFIX):
        return None
    return path.name.removeprefix(directory.DISCARDED_PREFIX).rsplit(".", 1)[0]


def device_mode_left_out(rank: int, world_size: int) -> dict[str, str]:
    """Where a tensor asked for on CUDA lands on a CPU process: outside `without_device_mode`, inside it, after it,
    and inside it under another torch-function mode (which it leaves alone)."""
    init_distributed(MegatronConfig(), seed=SEED)

    def placed() -> str:
        try:
            return torch.zeros(1, device="cuda").device.type
        except RuntimeError:
            return "refused"

    report = {"outside": placed()}
    with without_device_mode():
        report["inside"] = placed()
    report["after"] = placed()
    with _PassingOn() as other, without_device_mode():
        report["under_another_mode"] = placed()
    report["the_other_mode_saw"] = other.seen[0]
    return report


class _PassingOn(TorchFunctionMode):
    """A torch-function mode that changes nothing (a profiler's, say); it notes what it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def killed_mid_write(root: str) -> None:
    """The job the SIGKILL test kills: step 1 saved and published, step 2's write under way (its writer sleeps
    after writing its shards); prints `writing` and waits to be killed."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29555"))  # fmt: skip
    init_distributed(MegatronConfig(), seed=SEED)
    actor, optimizer, _ = _build(MegatronConfig())
    saves = AsyncSaves()
    save = functools.partial(store.save_checkpoint, Path(root), models={"actor": actor},
                             optimizers={"actor": optimizer}, run=RUN, keep=2, saves=saves)  # fmt: skip
    save(step=1, trainer_state={"step": 1})
    saves.wait()
    slow_writes(600)
    with torch.no_grad():
        for parameter in actor.chunks[0].parameters():
            parameter.add_(1.0)
    save(step=2, trainer_state={"step": 2})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any((Path(root) / ".tmp_step_2").glob("*.distcp")):
        time.sleep(0.05)
    print("writing", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    killed_mid_write(sys.argv[1])
