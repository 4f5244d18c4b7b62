"""Workers of tests/distributed/test_run_state.py: what a checkpoint's `trainer_state.pt` holds, and a checkpoint saved
by the trainer of 2026-12-06 (before the loop was split into parts, `tests/fixtures/trainer_checkpoint/`) resumed and
rolled back to by today's trainer."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_ppo.checkpoint.directory import TRAINER_STATE
from megatron_ppo.parallel import init_distributed
from tests.distributed.memory_workers import tiny_config
from tests.distributed.update_workers import grpo_rows

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trainer_checkpoint"
FIXTURE_STEP = 1
SMALL = ("model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2")  # a fixture of ~0.6 MB


def _trainer(root: str, *overrides: str):
    from megatron_ppo.train.ppo import PPOTrainer

    config = tiny_config(root, *SMALL, "trainer.total_training_steps=3", "trainer.save_freq=1", *overrides)
    init_distributed(config.actor.megatron, seed=0)
    return PPOTrainer(config, grpo_rows(prompts=24, per_prompt=4, seed=5), pad_id=0)


def write_fixture(rank: int, world_size: int, root: str) -> None:
    """The fixture: one iteration of the tiny config, saved and published (run once, by hand, with the code of its
    date and the floor leg's megatron-core, whose checkpoint format both legs read:
    `PYTHONPATH=.venv/floor python -m tests.distributed.run_state_workers`)."""
    trainer = _trainer(root)
    try:
        trainer.resume()
        trainer.iteration()
        trainer.save(wait=True)
    finally:
        trainer.close()


def saved_state(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Today's trainer, one iteration, saved: the keys of its `trainer_state.pt`, and of its parts' entries."""
    trainer = _trainer(root)
    try:
        trainer.resume()
        trainer.iteration()
        path = trainer.save(wait=True)
    finally:
        trainer.close()
    state = torch.load(Path(path) / TRAINER_STATE, weights_only=True)
    nested = {key: sorted(value) for key, value in state.items() if isinstance(value, dict)}
    return {"keys": sorted(state), "nested": nested}


def resume_and_roll_back(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Today's trainer on a copy of the fixture: it resumes at the fixture's step, runs an iteration, and a rollback
    into the fixture's checkpoint restores its step, sampler and learning rates (× the rollback's factor)."""
    from megatron_ppo.train.guards import GuardAction

    shutil.copytree(FIXTURE, Path(root) / "checkpoints")
    trainer = _trainer(root, "trainer.save_freq=0")
    try:
        resumed_from = trainer.resume()
        step_after_resume = trainer.step
        sampler = trainer.sampler.state_dict()
        lr = trainer.schedulers["actor"].get_lr(trainer.optimizers["actor"].param_groups[0])
        trainer.iteration()
        step_after_iteration = trainer.step
        action = GuardAction(kind="rollback", guard="kl_explosion", message="test", factor=0.5, max_rollbacks=3,
                             value=1.0)  # fmt: skip
        trainer.respond([action])
        rolled_lr = trainer.schedulers["actor"].get_lr(trainer.optimizers["actor"].param_groups[0])
        return {"resumed_from": str(resumed_from), "step_after_resume": step_after_resume,
                "step_after_iteration": step_after_iteration, "step_after_rollback": trainer.step,
                "sampler_restored": trainer.sampler.state_dict() == sampler, "lr": lr,
                "rolled_lr": rolled_lr}  # fmt: skip
    finally:
        trainer.close()


if __name__ == "__main__":
    from tests.distributed.harness import run_distributed

    with __import__("tempfile").TemporaryDirectory() as folder:
        run_distributed(write_fixture, 1, folder)
        if FIXTURE.exists():
            shutil.rmtree(FIXTURE)
        shutil.copytree(Path(folder) / "checkpoints", FIXTURE, ignore=shutil.ignore_patterns(".lock"))


def rollbacks_into_one_checkpoint(rank: int, world_size: int, root: str, min_lr_fraction: float) -> dict[str, Any]:
    """From the fixture's checkpoint (good: the run resumed from it): an iteration, then a rollback into it, three
    times; then a fourth rollback asked for. Each replay's update metrics and each rollback's learning-rate back-off,
    and the message a refused rollback stops with."""
    from megatron_ppo.train.guards import GuardAction, GuardStopped

    shutil.copytree(FIXTURE, Path(root) / "checkpoints")
    trainer = _trainer(root, "trainer.save_freq=0", f"guards.min_lr_fraction={min_lr_fraction}")
    action = GuardAction(kind="rollback", guard="kl_explosion", message="injected", factor=0.5, max_rollbacks=3,
                         value=1.0)  # fmt: skip
    replays, backoffs, steps, stopped = [], [], [], None
    try:
        trainer.resume()
        for _ in range(4):
            metrics = trainer.iteration()
            steps.append(trainer.step)
            replays.append([metrics[key] for key in ("actor/pg_loss", "actor/ref_kl", "actor/grad_norm")])
            try:
                trainer.respond([action])
            except GuardStopped as stop:
                stopped = str(stop)
                break
            backoffs.append(trainer.schedulers["actor"].backoff)
    finally:
        trainer.close()
    return {"replays": replays, "backoffs": backoffs, "steps": steps, "stopped": stopped}


def resume_with_another_width(rank: int, world_size: int, root: str) -> str:
    """The fixture resumed (`auto`) by a config whose model is twice as wide: the refusal's message."""
    from megatron_ppo.config.errors import ConfigError

    shutil.copytree(FIXTURE, Path(root) / "checkpoints")
    try:
        _trainer(root, "model.hidden_size=64")
    except ConfigError as error:
        return str(error)
    return "not refused"


def resume_damaged_without_manifest(rank: int, world_size: int, root: str) -> str:
    """The fixture with its manifest gone and a shard cut in half (nothing can tell it is damaged before the read):
    the refusal's message on resuming it."""
    from megatron_ppo.config.errors import UserError

    shutil.copytree(FIXTURE, Path(root) / "checkpoints")
    step = Path(root) / "checkpoints" / f"step_{FIXTURE_STEP}"
    (step / "manifest.json").unlink()
    shard = sorted(step.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    trainer = _trainer(root, "trainer.save_freq=0")
    try:
        trainer.resume()
    except UserError as error:
        return str(error)
    finally:
        trainer.close()
    return "not refused"
