"""Spawned-rank code for the host-offload tests: the real trainer (random tiny GPT, GAE with a critic) with its
roles' weights, gradients and optimizer states moved off the device between phases."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel

from megatron_ppo.config import load_config
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.parallel import init_distributed
from megatron_ppo.planner.phases import OFFLOAD_KINDS, PHASE_NEEDS, resident_kinds
from megatron_ppo.planner.plan import plan_role
from megatron_ppo.train.preemption import JobBudgetReached
from tests.distributed.update_workers import grpo_rows
from tests.distributed.workers import weights

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
# every kind for each trained role, the frozen reference's parameters (spelled out: tests/unit/test_cpu_coverage.py
# reads which flags this test sets)
ALL_OFFLOADED = [
    *(f"{role}.megatron.{kind}=true" for role in ("actor", "critic")
      for kind in ("param_offload", "grad_offload", "optimizer_offload")),
    "ref.megatron.param_offload=true",
]  # fmt: skip


def _config(root: str, offload: bool, extra: list[str] = (), distributed_optimizer: bool = False) -> PPOConfig:
    """The tiny recipe's model at TP 1 on random weights, batches of 16 rows in micro-batches of 4. (Runs that save
    checkpoints keep Megatron's plain optimizer: its distributed one's sharded state fails to save on this
    megatron-core, "ShardedTensor.flattened_range is not supported".)"""
    layout = f"{{tensor_model_parallel_size: 1, use_distributed_optimizer: {str(distributed_optimizer).lower()}}}"
    return load_config(RECIPE, [
        "data.task=null", "model.allow_random_init=true", "trainer.logger=[]", "cluster.gpus_per_node=1",
        "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=4",
        "critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size_per_gpu=4", "trainer.total_training_steps=2",
        f"actor.megatron={layout}", f"critic.megatron={layout}", "ref.megatron={tensor_model_parallel_size: 1}",
        f"trainer.default_local_dir={root}/checkpoints", f"trainer.log_dir={root}/logs",
        *(ALL_OFFLOADED if offload else []), *extra,
    ])  # fmt: skip


def _trainer(config: PPOConfig):
    from megatron_ppo.train.ppo import PPOTrainer

    return PPOTrainer(config, grpo_rows(prompts=8, per_prompt=4, seed=3), pad_id=0)


def _measured_values(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """The metrics of each step without wall-clock timings and throughput, which no two runs share."""
    return [{k: v for k, v in step.items() if not k.startswith(("perf/", "timing/"))} for step in history]


def _final(trainer) -> dict[str, Any]:
    return {
        "history": _measured_values(trainer.history),
        # plain lists: tensors would travel back through shared memory that dies with this process
        "weights": {role: {k: v.tolist() for k, v in weights(model).items()} for role, model in trainer.models.items()},
    }


def run_to_the_end(rank: int, world_size: int, root: str, offload: bool) -> dict[str, Any]:
    """Two iterations of the trainer, with every role's state offloaded between phases or none."""
    config = _config(root, offload)
    init_distributed(config.actor.megatron, seed=0)
    trainer = _trainer(config)
    trainer.fit()
    trainer.close()
    return _final(trainer)


def one_job_of_a_chain(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """With everything offloaded and `trainer.exit_interval=1`: a job resumes the run in `root` if it has a
    checkpoint, then stops after one step with a checkpoint (JobBudgetReached) or finishes the run. A new process
    per job, as a real chain: the reference (`allow_random_init`: a copy of the actor's first random weights, not
    checkpointed) is drawn again from the same seed."""
    config = _config(root, offload=True, extra=["trainer.exit_interval=1"])
    init_distributed(config.actor.megatron, seed=0)
    trainer = _trainer(config)
    resumed_from = trainer.resume()
    with contextlib.suppress(JobBudgetReached):
        trainer.fit()
    trainer.close()
    return _final(trainer) | {"resumed_from": str(resumed_from)}


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _measured(trainer) -> dict[str, dict[str, int]]:
    """Bytes held now, read from the tensors themselves: every parameter, the DDP grad buffers, the optimizer's
    Adam moments and fp32 main params (zero where a storage was emptied)."""
    out = {}
    for role in ("actor", "critic", "ref"):
        model = getattr(trainer, role)
        grads = [b.grad_data for c in model.chunks if isinstance(c, DistributedDataParallel) for b in c.buffers]
        optimizer = trainer.optimizers.get(role)
        moments = []
        if optimizer is not None:
            for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
                moments += [s[k] for s in inner.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
        out[role] = {
            "params": _storage_bytes([p for c in model.chunks for p in c.parameters()]),
            "grads": _storage_bytes(grads),
            "optimizer": _storage_bytes(moments),
        }
    return out


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    """Copies of every weight and Adam moment, by name."""
    out = {f"{role}.{name}": value.clone() for role in ("actor", "critic", "ref")
           for name, value in weights(getattr(trainer, role)).items()}  # fmt: skip
    for role, optimizer in trainer.optimizers.items():
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            for index, state in enumerate(inner.optimizer.state.values()):
                out |= {f"{role}.adam{index}.{k}": state[k].clone() for k in ("exp_avg", "exp_avg_sq")}
    return out


def placement_by_phase(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """After one iteration (Adam states exist), enter each phase in turn and record where every role's params,
    grads and optimizer states are — from HostOffload's count and from the tensors — next to the planner's rule
    and byte estimates; then check that coming back restores every weight and moment exactly and zeroes grads."""
    config = _config(root, offload=True, distributed_optimizer=True)
    init_distributed(config.actor.megatron, seed=0)
    trainer = _trainer(config)
    lines: list[str] = []
    trainer.offload.report = lines.append
    trainer.iteration()
    before = _snapshot(trainer)
    phases = {}
    for phase in [*PHASE_NEEDS, "actor update"]:
        counted = trainer.offload.enter(phase)
        phases[phase] = {
            "counted": counted,
            "measured": _measured(trainer),
            "planned_kinds": {
                role: sorted(resident_kinds(phase, role, getattr(config, role).megatron))
                for role in ("actor", "critic", "ref")
            },
        }
    grads_zero = all(bool((b.grad_data == 0).all()) for c in trainer.actor.chunks for b in c.buffers)
    trainer.offload.enter("between iterations")
    after = _snapshot(trainer)
    planned_gib = {}
    for role in ("actor", "critic", "ref"):
        plan = plan_role(config, role)
        planned_gib[role] = {"params": plan.weights_gib, "grads": plan.grads_gib, "optimizer": plan.optimizer_gib}
    trainer.close()
    return {
        "phases": phases,
        "planned_bytes": {r: {k: v * 2**30 for k, v in kinds.items()} for r, kinds in planned_gib.items()},
        "changed": sorted(name for name in before if not torch.equal(before[name], after[name])),
        "moments": sum(1 for name in before if ".adam" in name),
        "grads_zero_after_return": grads_zero,
        "lines": lines,
        "kinds": OFFLOAD_KINDS,
    }
