"""Spawned-rank code for the memory-release tests: what a dropped trainer and a failed pass leave alive, read with
weak references while the cycle collector is off (what is freed then is freed by reference counting alone)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from megatron_ppo.config import load_config
from megatron_ppo.models import unwrap
from megatron_ppo.parallel import init_distributed
from tests.distributed.update_workers import grpo_rows

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def tiny_config(root: str, *overrides: str):
    """The tiny recipe's model at TP 1 on one process, random weights, rows of its own (no task to build)."""
    return load_config(RECIPE, [
        "data.task=null", "model.allow_random_init=true", "trainer.logger=[]", "cluster.gpus_per_node=1",
        "data.train_batch_size=32", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=8", "trainer.total_training_steps=2",
        "data.addition.sft_batch_size=16",
        *(f"{role}.megatron.tensor_model_parallel_size=1" for role in ("actor", "ref", "critic", "reward_model")),
        f"trainer.default_local_dir={root}/checkpoints", f"trainer.log_dir={root}/tensorboard", *overrides,
    ])  # fmt: skip


@contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _references(trainer) -> dict[str, weakref.ref]:
    """Weak references to the trainer, each model, its chunks, a parameter, each optimizer and its inner ones."""
    refs: dict[str, weakref.ref] = {"trainer": weakref.ref(trainer)}
    for role, model in trainer.roles.built().items():
        refs[role] = weakref.ref(model)
        for index, chunk in enumerate(model.chunks):
            refs[f"{role} chunk {index}"] = weakref.ref(chunk)
        refs[f"{role} parameter"] = weakref.ref(next(model.chunks[0].parameters()))
    for role, optimizer in trainer.optimizers.items():
        refs[f"{role} optimizer"] = weakref.ref(optimizer)
        for index, inner in enumerate(getattr(optimizer, "chained_optimizers", [])):
            refs[f"{role} optimizer {index}"] = weakref.ref(inner)
    return refs


def dropped_trainers_are_freed(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Three trainers built, run for an iteration (optimizer states created), closed and dropped one after another,
    then a model trained by the tiny task's SFT and dropped: what of each is still alive without the collector."""
    from megatron_ppo.tasks.addition.recipe import sft
    from megatron_ppo.train.ppo import PPOTrainer

    config = tiny_config(root)
    init_distributed(config.actor.megatron, seed=0)
    rows = grpo_rows(prompts=24, per_prompt=4, seed=5)
    alive: dict[str, list[str]] = {}
    with collector_off():
        for attempt in range(3):
            trainer = PPOTrainer(config, rows, pad_id=0)
            trainer.iteration()
            trainer.close()
            refs = _references(trainer)
            del trainer
            alive[f"trainer {attempt}"] = sorted(name for name, ref in refs.items() if ref() is not None)
        sft_model = sft(config, config.actor.megatron, rows, pad_id=0, steps=2)
        refs = {"sft model": weakref.ref(sft_model), "sft chunk": weakref.ref(sft_model.chunks[0])}
        loss_scaling_kept = sft_model.config.grad_scale_func is not None  # its optimizer was dropped in `sft`
        del sft_model
        alive["sft"] = sorted(name for name, ref in refs.items() if ref() is not None)
    return {"alive": alive, "references": len(refs), "loss_scaling_kept": loss_scaling_kept}


def failed_pass_is_released(rank: int, world_size: int, root: str, release: bool) -> dict[str, Any]:
    """One trainer iteration whose actor update runs out of memory in the last layer's `linear_fc1` (after the
    pre-MLP norm: what megatron-core 0.19 keeps on the layer, `mlp_norm_manager`) on its first micro-batch; the
    back-off retries it. Returns whether the failed pass's activation at the norm's input (and its graph) was alive
    when the retry began its forward, and the names the release set to None. `release=False` runs the trainer
    with the release disabled (the test's red case)."""
    import megatron_ppo.train.phases as phases
    from megatron_ppo.train.ppo import PPOTrainer

    config = tiny_config(root)
    init_distributed(config.actor.megatron, seed=0)
    trainer = PPOTrainer(config, grpo_rows(prompts=24, per_prompt=4, seed=5), pad_id=0)
    layers = unwrap(trainer.actor.chunks[0]).decoder.layers
    seen: dict[str, Any] = {"norm_inputs": [], "failed": None, "alive_at_retry": None, "released": []}

    def record_norm_input(_module, args):
        if torch.is_grad_enabled():
            seen["norm_inputs"].append(weakref.ref(args[0]))

    def fail_once(_module, args):
        if torch.is_grad_enabled() and seen["failed"] is None:  # the update's first micro-batch, not the experience's
            seen["failed"] = seen["norm_inputs"][-1]
            raise torch.OutOfMemoryError("injected: out of memory in linear_fc1")

    def check_at_retry_start(_module, args):  # the retry's first layer: everything it computes comes after this
        if torch.is_grad_enabled() and seen["failed"] is not None and seen["alive_at_retry"] is None:
            seen["alive_at_retry"] = seen["failed"]() is not None

    layers[0].input_layernorm.register_forward_pre_hook(check_at_retry_start)
    layers[-1].pre_mlp_layernorm.register_forward_pre_hook(record_norm_input)
    layers[-1].mlp.linear_fc1.register_forward_pre_hook(fail_once)
    original = phases.release_failed_pass

    def release_and_record(model):
        names = original(model) if release else []
        seen["released"] += names
        return names

    phases.release_failed_pass = release_and_record
    try:
        metrics = trainer.iteration()
    finally:
        phases.release_failed_pass = original
        trainer.close()
    return {"alive_at_retry": seen["alive_at_retry"], "released": seen["released"],
            "retries": trainer.memory.retries, "finite": all(v == v for v in metrics.values())}  # fmt: skip
