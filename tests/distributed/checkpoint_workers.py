"""Spawned-rank code for the checkpoint tests."""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import psutil
import torch

from megatron_ppo.checkpoint import directory, store
from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.checkpoint.run_start import start_run
from megatron_ppo.checkpoint.verify import CheckpointError
from megatron_ppo.config.errors import UserError
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import LoraSettings, MegatronConfig, OptimConfig, PPOConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.models.gpt import sync_parameters
from megatron_ppo.parallel import init_distributed
from megatron_ppo.parallel.collectives import barrier
from megatron_ppo.train.micro_batching import MicroBatching
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from megatron_ppo.train.update import actor_loss, update_role
from tests.distributed.workers import MODEL, OPTIM, ROWS, SEED, experience, ppo_config, weights

RUN = RunIdentity.of("a-run", PPOConfig())


def publish_and_recover(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save steps 1 and 2, then break things the way a killed save or a lost file would."""
    root = Path(root)
    init_distributed(MegatronConfig(), seed=0)
    actor = build_role_model("actor", MODEL, MegatronConfig())
    optimizer = build_optimizer(actor, OptimConfig(lr=1e-3), MegatronConfig())
    report: dict[str, Any] = {}
    for step in (1, 2):
        with torch.no_grad():
            for parameter in actor.chunks[0].parameters():
                parameter.add_(0.01 * step)
        store.save_checkpoint(root, step, {"actor": actor}, {"actor": optimizer}, {"step": step}, run=RUN, keep=5)
    saved_at_2 = weights(actor)
    report["after_two_saves"] = directory.find_resumable(root).name
    (root / ".tmp_step_3").mkdir()
    (root / ".tmp_step_3" / "partial.distcp").write_bytes(b"half a shard")
    report["with_a_half_written_save"] = directory.find_resumable(root).name
    with torch.no_grad():
        for parameter in actor.chunks[0].parameters():
            parameter.zero_()
    state = store.load_checkpoint(root / "step_2", {"actor": actor}, {"actor": optimizer})
    report["restored_step"] = state["step"]
    report["weights_restored"] = all(torch.equal(v, saved_at_2[k]) for k, v in weights(actor).items())
    (root / "step_2" / "metadata.json").unlink()
    report["with_step_2_broken"] = directory.find_resumable(root).name
    store.save_checkpoint(root, 4, {"actor": actor}, {"actor": optimizer}, {"step": 4}, run=RUN, keep=1)
    report["kept_after_prune"] = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    report["set_aside_after_prune"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".discarded"))
    # set aside for deletion: a complete copy under a newer step's name, and one a kill left half deleted
    shutil.copytree(root / "step_4", root / f"{directory.DISCARDED_PREFIX}step_9.1")
    shutil.copytree(root / "step_4", root / f"{directory.DISCARDED_PREFIX}step_4.2")
    (root / f"{directory.DISCARDED_PREFIX}step_4.2" / directory.TRAINER_STATE).unlink()
    (root / directory.LATEST).unlink()  # no `latest`: the newest complete checkpoint is looked for
    report["with_set_aside_copies"] = (directory.find_resumable(root).name,
                                       [p.name for _, p in directory.complete_checkpoints(root)])  # fmt: skip
    store.save_checkpoint(root, 5, {"actor": actor}, {"actor": optimizer}, {"step": 5}, run=RUN, keep=1)
    report["set_aside_after_save_5"] = sorted(p.name for p in root.iterdir() if p.name.startswith(".discarded"))
    report["processes_started"] = [" ".join(child.cmdline()) for child in psutil.Process().children(recursive=True)]
    return report


def _actor_and_optimizer():
    actor = build_role_model("actor", MODEL, MegatronConfig())
    return actor, build_optimizer(actor, OptimConfig(lr=1e-3), MegatronConfig())


def _config(root: Path, **trainer: Any) -> PPOConfig:
    config = PPOConfig()
    config.trainer.default_local_dir, config.trainer.log_dir = str(root / "ckpt"), str(root / "tb")
    for key, value in trainer.items():
        setattr(config.trainer, key, value)
    return config


def _listing(root: Path) -> dict[str, str | None]:
    """{step_N: the run that saved it} under `root`, and `latest`, as every rank sees it before rank 0 goes on."""
    found = {path.name: directory.run_of(path) for _, path in directory.step_directories(root)}
    found["latest"] = (root / "latest").read_text() if (root / "latest").is_file() else None
    barrier()
    return found


def two_runs_in_one_directory(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The issue's case at the checkpoint level: run A saves steps 2, 4, 6 keeping 2; run B then saves steps 2 and 3
    into the same directory, keeping 2. Then a run that resumed from an older checkpoint of its own prunes."""
    root = Path(root)
    init_distributed(MegatronConfig(), seed=0)
    actor, optimizer = _actor_and_optimizer()
    run_a, run_b = RunIdentity.of("run-a", PPOConfig()), RunIdentity.of("run-b", PPOConfig())
    save = functools.partial(store.save_checkpoint, models={"actor": actor}, optimizers={"actor": optimizer})
    shared = root / "shared"
    for step in (2, 4, 6):
        save(shared, step, trainer_state={"step": step}, run=run_a, keep=2)
    for step in (2, 3):
        save(shared, step, trainer_state={"step": step}, run=run_b, keep=2)
    report: dict[str, Any] = {"shared": _listing(shared)}
    resumable = directory.find_resumable(shared)
    report["resumable"] = (resumable.name, directory.run_of(resumable))
    branch = root / "branch"  # steps 1-4 saved, the run resumes from step_2 and saves step_3 again, keeping 2
    for step in (1, 2, 3, 4):
        save(branch, step, trainer_state={"step": step}, run=run_a, keep=3)
    directory.point_latest_at(branch / "step_2")
    save(branch, 3, trainer_state={"step": 3}, run=run_a, keep=2)
    report["branch"] = _listing(branch)
    save(branch, 3, trainer_state={"step": 3, "again": True}, run=run_a, keep=2)  # a rollback to step_3 saves it again
    report["saved_again"] = (
        _listing(branch),
        sorted(p.name for p in branch.iterdir() if p.name.startswith(".")),
        torch.load(branch / "step_3" / directory.TRAINER_STATE, weights_only=True).get("again"),
    )
    (branch / "step_3").rename(branch / ".replaced_step_3")  # killed between the two renames of a save
    restored = directory.restore_replaced(branch)
    report["restored"] = (restored.name, directory.is_complete(restored), directory.restore_replaced(branch))
    return report


def start_rules(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """`start_run` on every rank against a directory holding run A's steps 2, 4, 6: a new run is refused, a resume
    continues A and lists the changed keys, a resume from an older checkpoint repoints `latest`, overwrite moves A
    aside, and a checkpoint without identity cannot be continued."""
    root = Path(root)
    init_distributed(MegatronConfig(), seed=0)
    actor, optimizer = _actor_and_optimizer()
    report: dict[str, Any] = {}
    first = start_run(_config(root, resume_mode="disable"))
    for step in (2, 4, 6):
        store.save_checkpoint(root / "ckpt", step, {"actor": actor}, {"actor": optimizer}, {"step": step},
                                   run=first.identity, keep=2)  # fmt: skip
    report["first"] = (first.identity.run_id, first.resume_from, str(first.log_dir), first.messages)
    try:
        start_run(_config(root, resume_mode="disable"))
    except UserError as refusal:
        report["refused"] = str(refusal)
    report["after_refusal"] = _listing(root / "ckpt")
    changed = _config(root, resume_mode="auto", exit_interval=3)
    changed.actor.optim.lr = 2e-3
    resumed = start_run(changed)
    report["resumed"] = (resumed.identity.run_id, resumed.resume_from.name, str(resumed.log_dir), resumed.messages)
    older = start_run(_config(root, resume_mode="resume_path", resume_from_path=str(root / "ckpt" / "step_4")))
    before_load = _listing(root / "ckpt")["latest"]
    store.load_checkpoint(older.resume_from, {"actor": actor}, {"actor": optimizer})  # as the trainer does, then
    if rank == 0:
        directory.point_latest_at(older.name_in_latest)  # it names the checkpoint (`PPOTrainer.resume`)
    barrier()  # every rank reads `latest` after rank 0 moved it (as `CheckpointKeeper.name_in_latest` waits)
    report["older"] = (older.identity.run_id, older.resume_from.name, older.messages, before_load,
                       _listing(root / "ckpt"))  # fmt: skip
    fresh = start_run(_config(root, resume_mode="disable", overwrite=True))
    moved = sorted((root / "ckpt" / "moved-aside").iterdir())
    report["fresh"] = (fresh.identity.run_id, fresh.resume_from, fresh.messages, _listing(root / "ckpt"),
                       [(m.name, _listing(m)) for m in moved])  # fmt: skip
    # two runs' checkpoints side by side (as saved by hand); resuming one of them with overwrite moves only the other
    for step, identity in ((1, fresh.identity), (6, first.identity)):
        store.save_checkpoint(root / "ckpt", step, {"actor": actor}, {"actor": optimizer}, {"step": step},
                                   run=identity)  # fmt: skip
    mixed = start_run(_config(root, resume_mode="resume_path", resume_from_path=str(root / "ckpt" / "step_6"),
                              overwrite=True))  # fmt: skip
    moved_now = [_listing(m) for m in sorted((root / "ckpt" / "moved-aside").iterdir()) if m not in moved]
    report["mixed"] = (mixed.identity.run_id, mixed.resume_from.name, _listing(root / "ckpt"), moved_now)
    store.save_checkpoint(root / "init", 1, {"actor": actor}, {}, {"step": 1})
    try:
        start_run(_config(root, resume_mode="resume_path", resume_from_path=str(root / "init")))
    except UserError as refusal:
        report["no_identity"] = str(refusal)
    auto_over_init = _config(root, resume_mode="auto")
    auto_over_init.trainer.default_local_dir = str(root / "init")
    try:
        start_run(auto_over_init)
    except UserError as refusal:
        report["auto_without_identity"] = str(refusal)
    return report


def _with_transformer_engine_extra_state(module: torch.nn.Module) -> None:
    """Make `module` carry an `_extra_state` entry as Transformer Engine's layers do (their FP8 metadata)."""
    extras = {"get_extra_state": lambda self: torch.tensor([7.0]), "set_extra_state": lambda self, state: None}
    module.__class__ = type(f"TE{type(module).__name__}", (type(module),), extras)


def local_checkpoint_into_extra_state_model(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A local-spec checkpoint loaded into a model whose core attention carries an `_extra_state`, as TE's
    `TEDotProductAttention` does and the local spec's never writes; then into a model with a weight the checkpoint
    lacks."""
    root = Path(root)
    init_distributed(MegatronConfig(), seed=0)
    actor = build_role_model("actor", MODEL, MegatronConfig())
    saved = store.save_checkpoint(root, 1, {"actor": actor}, {}, {"step": 1})
    te_like = build_role_model("actor", MODEL, MegatronConfig())
    gpt = te_like.chunks[0].module
    for layer in gpt.decoder.layers:
        _with_transformer_engine_extra_state(layer.self_attention.core_attention)
    report: dict[str, Any] = {
        "extra_state_keys": sum(k.endswith("core_attention._extra_state") for k in gpt.state_dict())
    }
    store.load_checkpoint(saved, {"actor": te_like}, {})
    expected = weights(actor)
    report["weights_loaded"] = all(
        torch.equal(v, expected[k]) for k, v in weights(te_like).items() if not k.endswith("_extra_state")
    )
    gpt.decoder.final_layernorm.register_parameter("extra_weight", torch.nn.Parameter(torch.ones(3)))
    try:
        store.load_weights(te_like, saved, "actor")
        report["missing_weight_error"] = None
    except CheckpointError as error:
        report["missing_weight_error"] = str(error)
    return report


def _one_update(actor, optimizer, scheduler, config, seed: int) -> dict[str, float]:
    """One actor update (two mini-batches: two optimizer steps) on rows drawn with `seed`: its metrics."""
    batch = experience(ROWS, seed=seed)
    make_loss = partial(actor_loss, config.actor, kl_loss_coef=0.1, vocab_size=MODEL.vocab_size)
    micro = MicroBatching(config.actor.ppo_micro_batch_size_per_gpu)
    update = update_role("actor", actor, optimizer, scheduler, batch, config=config.actor, micro=micro,
                         make_loss=make_loss)  # fmt: skip
    return {"grad_norms": [step.grad_norm for step in update.steps], **update.metrics}


def resumed_optimizer_takes_the_same_step(
    rank: int, world_size: int, root: str, layout: MegatronConfig, lora: dict | None = None
) -> dict:
    """Two updates, a save, a third update; then a fresh actor and optimizer load the save and take the third update
    again. Adam's moments, step counts and main weights come back from the checkpoint, so the third update's
    metrics and the weights after it are the same, bit for bit (same layout, same processes). `lora`: the actor
    with adapters (`LoraSettings` fields), whose checkpoint holds the adapters and their optimizer states."""
    root = Path(root)
    init_distributed(layout, seed=SEED)
    config = with_changes(ppo_config(layout), {"actor.ppo_mini_batch_size": ROWS // 2})
    optim = dataclasses.replace(OPTIM, lr=1e-2, weight_decay=0.1, adam_eps=1e-8, lr_decay_style="constant")

    def build():
        actor = build_role_model("actor", MODEL, layout, lora=LoraSettings(**lora) if lora else None)
        optimizer = build_optimizer(actor, optim, layout)
        return actor, optimizer, build_scheduler(optimizer, optim, total_steps=10)

    actor, optimizer, scheduler = build()
    for seed in (1, 2):
        _one_update(actor, optimizer, scheduler, config, seed)
    saved = store.save_checkpoint(root, 2, {"actor": actor}, {"actor": optimizer}, {"step": 2})
    uninterrupted = _one_update(actor, optimizer, scheduler, config, seed=3)
    sync_parameters(actor)
    expected = weights(actor)
    actor, optimizer, scheduler = build()
    store.load_checkpoint(saved, {"actor": actor}, {"actor": optimizer})
    resumed = _one_update(actor, optimizer, scheduler, config, seed=3)
    sync_parameters(actor)
    differences = {name: (value - expected[name]).abs().max().item() for name, value in weights(actor).items()}
    return {"uninterrupted": uninterrupted, "resumed": resumed, "largest_weight_difference": max(differences.values())}


def resumed_at_another_learning_rate(rank: int, world_size: int, root: str, layout: MegatronConfig) -> dict:
    """Two updates at lr A, a save (with the schedule's state), one more update at A; then a fresh actor, optimizer
    and schedule built with lr 2A load the save and take that update again. One optimizer step from the same
    weights, moments and gradient: AdamW's step −lr·(m̂/(√v̂+ε) + wd·w) at 2A is twice the step at A. Then one built
    with another Adam β₂ loads the save: its groups keep the config's β₂."""
    root = Path(root)
    init_distributed(layout, seed=SEED)
    config = ppo_config(layout)  # one mini-batch of ROWS: one optimizer step per update
    optim = dataclasses.replace(OPTIM, lr=1e-2, weight_decay=0.1, adam_eps=1e-8, lr_decay_style="constant")

    def build(**changes: float):
        actor = build_role_model("actor", MODEL, layout)
        optimizer = build_optimizer(actor, dataclasses.replace(optim, **changes), layout)
        return actor, optimizer, build_scheduler(optimizer, dataclasses.replace(optim, **changes), total_steps=10)

    def groups(optimizer) -> list[dict]:
        return [group for inner in getattr(optimizer, "chained_optimizers", [optimizer])
                for group in inner.optimizer.param_groups]  # fmt: skip

    actor, optimizer, scheduler = build()
    for seed in (1, 2):
        _one_update(actor, optimizer, scheduler, config, seed)
    schedule = {"scheduler": scheduler.state_dict()}
    saved = store.save_checkpoint(root, 2, {"actor": actor}, {"actor": optimizer}, schedule)
    sync_parameters(actor)
    before = weights(actor)
    _one_update(actor, optimizer, scheduler, config, seed=3)
    sync_parameters(actor)
    step_at_a = {name: value - before[name] for name, value in weights(actor).items()}
    actor, optimizer, scheduler = build(lr=2 * optim.lr)
    state = store.load_checkpoint(saved, {"actor": actor}, {"actor": optimizer})
    scheduler.load_state_dict(state["scheduler"])
    report = {key: sorted({group[key] for group in groups(optimizer)}) for key in ("max_lr", "lr")}
    report["scheduler_max_lr"] = scheduler.max_lr
    _one_update(actor, optimizer, scheduler, config, seed=3)
    sync_parameters(actor)
    step_at_2a = {name: value - before[name] for name, value in weights(actor).items()}
    report["largest_step"] = max(step.abs().max().item() for step in step_at_a.values())
    report["largest_difference_from_twice"] = max(
        (step_at_2a[name] - 2 * step).abs().max().item() for name, step in step_at_a.items()
    )
    actor, optimizer, scheduler = build(adam_beta2=0.95)
    store.load_checkpoint(saved, {"actor": actor}, {"actor": optimizer})
    report["betas"] = sorted({tuple(group["betas"]) for group in groups(optimizer)})
    return report


def damaged_checkpoints(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Run A saves steps 2, 4, 6 (keeping 2); then its checkpoints are damaged one way after another: a shard of the
    one `latest` names truncated, a trainer state truncated in a checkpoint without manifest, a run id that is a
    path."""
    root, ckpt = Path(root), Path(root) / "ckpt"
    init_distributed(MegatronConfig(), seed=0)
    actor, optimizer = _actor_and_optimizer()
    run = start_run(_config(root, resume_mode="disable")).identity
    for step in (2, 4, 6):
        store.save_checkpoint(ckpt, step, {"actor": actor}, {"actor": optimizer}, {"step": step}, run=run, keep=2)
    report: dict[str, Any] = {"manifest": sorted(json.loads((ckpt / "step_6" / "manifest.json").read_text())["files"])}
    shard = sorted((ckpt / "step_6").glob("*.distcp"))[0]
    if rank == 0:
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    barrier()
    report["damage"] = directory.damage(ckpt / "step_6")
    auto = start_run(_config(root, resume_mode="auto"))
    report["auto"] = (auto.resume_from.name, auto.messages[0], auto.name_in_latest.name, _listing(ckpt)["latest"])
    try:
        start_run(_config(root, resume_mode="resume_path", resume_from_path=str(ckpt / "step_6")))
    except UserError as refusal:
        report["resume_path"] = (str(refusal), _listing(ckpt)["latest"])
    # step_6 is damaged, not complete: the save of step 8 keeps 2 complete ones (4 and 8), the damaged one aside
    store.save_checkpoint(ckpt, 8, {"actor": actor}, {"actor": optimizer}, {"step": 8}, run=run, keep=2)
    report["after_prune"] = sorted(_listing(ckpt))
    if rank == 0:  # damage a checkpoint the manifest cannot speak for: the load itself says so
        (ckpt / "step_4" / "manifest.json").unlink()
        (ckpt / "step_4" / directory.TRAINER_STATE).write_bytes(b"PK\x03\x04 truncated")
    barrier()
    try:
        store.load_checkpoint(ckpt / "step_4", {"actor": actor}, {"actor": optimizer})
    except CheckpointError as unreadable:
        report["load"] = str(unreadable)
    if rank == 0:
        escaped = json.loads((ckpt / "step_8" / "run.json").read_text()) | {"run_id": "../../escaped"}
        (ckpt / "step_8" / "run.json").write_text(json.dumps(escaped))
    barrier()
    try:
        start_run(_config(root, resume_mode="auto"))
    except UserError as refusal:
        report["escape"] = str(refusal)
    report["outside"] = sorted(p.name for p in root.parent.iterdir() if p.name == "escaped")
    return report


def corrupted_in_place(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Run A saves step 2 synchronously and steps 4 and 6 asynchronously (each rank's writer hashes its shards);
    then one file of step_6 after another — each kind a checkpoint holds — is overwritten in its middle at its own
    size, and the run resumed with `auto`; the file is put back between kinds. Also what the keeper's rollback
    finds when its good checkpoint is the damaged one."""
    from megatron_ppo.checkpoint import verify
    from megatron_ppo.checkpoint.async_save import AsyncSaves

    root, ckpt = Path(root), Path(root) / "ckpt"
    init_distributed(MegatronConfig(), seed=0)
    actor, optimizer = _actor_and_optimizer()
    run = start_run(_config(root, resume_mode="disable")).identity
    store.save_checkpoint(ckpt, 2, {"actor": actor}, {"actor": optimizer}, {"step": 2}, run=run)
    saves = AsyncSaves()
    for step in (4, 6):
        store.save_checkpoint(ckpt, step, {"actor": actor}, {"actor": optimizer}, {"step": step}, run=run,
                              saves=saves)  # fmt: skip
        saves.wait()
    step_6 = ckpt / "step_6"
    manifest = json.loads((step_6 / verify.MANIFEST).read_text())
    writers = {}
    for digests in sorted(step_6.glob("digests_rank*.json")):
        writers[digests.name] = sorted(json.loads(digests.read_text()))
    report: dict[str, Any] = {"manifest": manifest, "writers": writers, "proven": directory.unproven(step_6),
                              "resumed": {}}  # fmt: skip
    kinds = {"a shard": sorted(step_6.glob("*.distcp"))[-1].name, "Megatron's metadata": ".metadata",
             "Megatron's metadata.json": "metadata.json", "the trainer state": directory.TRAINER_STATE,
             "the run identity": "run.json", "an RNG state": "rng_rank1.pt"}  # fmt: skip
    for kind, name in kinds.items():
        path = step_6 / name
        original = path.read_bytes()
        if rank == 0:
            middle = len(original) // 2
            path.write_bytes(original[:middle] + bytes(b ^ 0xFF for b in original[middle : middle + 16])
                             + original[middle + 16 :])  # fmt: skip
        barrier()
        if kind == "a shard":
            report["checked"] = directory.checked(ckpt)  # megatron-ppo verify-checkpoint
        started = start_run(_config(root, resume_mode="auto"))
        report["resumed"][kind] = (name, started.resume_from.name, " ".join(started.messages), path.stat().st_size
                                   == len(original))  # fmt: skip
        try:
            directory.resolve(step_6, prove=True)  # export; resume_path
        except CheckpointError as refusal:
            report["resumed"][kind] += (str(refusal),)
        barrier()
        if rank == 0:
            path.write_bytes(original)
            directory.point_latest_at(step_6)
        barrier()
    report["after_repair"] = directory.unproven(step_6)
    return report


def proven_together(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Files of several sizes with a manifest (rank 0 writes them), one overwritten in place; rank 0 asks
    `verify.corruption` inside `proving_together` while the others help: the message, and the files each rank
    hashed."""
    import torch.distributed as dist

    from megatron_ppo.checkpoint import proof, verify

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    checkpoint = Path(root) / "step_1"
    if rank == 0:
        checkpoint.mkdir(parents=True)
        for i, size in enumerate([9000, 7000, 5000, 3000, 1000, 800]):
            (checkpoint / f"__{i}_0.distcp").write_bytes(bytes([i]) * size)
        verify.write_manifest(checkpoint)
        with (checkpoint / "__3_0.distcp").open("r+b") as shard:
            shard.seek(100)
            shard.write(b"\xff" * 16)
    barrier()
    hashed: list[str] = []
    differing = verify.differing

    def counted(path, digests):
        hashed.extend(digests)
        return differing(path, digests)

    verify.differing = counted
    try:
        if rank == 0:
            with proof.proving_together():
                message = verify.corruption(checkpoint)
                clean = verify.corruption(Path(root) / "missing")  # no manifest: nothing asked of the others
        else:
            proof.help_prove()
            message = clean = None
    finally:
        verify.differing = differing
    return {"message": message, "clean": clean, "hashed": sorted(hashed)}
