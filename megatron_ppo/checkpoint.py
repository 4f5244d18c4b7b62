"""Checkpoints: Megatron `dist_checkpointing` for models and optimizers, plus the trainer's own state.

A checkpoint is written to `<root>/.tmp_step_N`, published by renaming it to `<root>/step_N`, and only then
named in `<root>/latest` (itself replaced atomically). A save killed at any point therefore leaves the previous
checkpoint as the newest complete one; `find_resumable` skips anything incomplete with a warning. Loading goes
through Megatron's sharded state dicts, so a checkpoint saved at one TP/PP layout loads at another.
"""

from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, tensor_parallel

from megatron_ppo.models import RoleModel, unwrap
from megatron_ppo.parallel.collectives import barrier, global_rank

logger = logging.getLogger(__name__)
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
OPTIMIZERS_SAVED = "checkpoint/optimizers_saved"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def model_sharded_state(model: RoleModel, prefix: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The role's sharded state dict (one entry per virtual-pipeline chunk), keys prefixed, `drop` keys removed."""
    state = {}
    for index, chunk in enumerate(model.chunks):
        chunk_state = unwrap(chunk).sharded_state_dict(prefix=prefix)
        state[f"model{index}"] = {k: v for k, v in chunk_state.items() if not any(d in k for d in drop)}
    return state


def _load_model_state(model: RoleModel, state: dict[str, Any], prefix: str, strict: bool) -> None:
    for index, chunk in enumerate(model.chunks):
        chunk_state = {key.removeprefix(prefix): value for key, value in state[f"model{index}"].items()}
        unwrap(chunk).load_state_dict(chunk_state, strict=strict)


def save_checkpoint(
    root: str | Path,
    step: int,
    models: dict[str, RoleModel],
    optimizers: dict[str, Any],
    trainer_state: dict[str, Any],
    keep: int | None = None,
) -> Path:
    """Save models (and their optimizers) under their role names, and `trainer_state` (plain Python/tensors)."""
    root = Path(root)
    final, temporary = root / f"step_{step}", root / f".tmp_step_{step}"
    if global_rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    barrier()
    sharded: dict[str, Any] = {}
    for role, model in models.items():
        sharded[role] = model_sharded_state(model, f"{role}.")
    # An optimizer that has not stepped yet (the actor during critic warm-up) has no state: it is recorded as
    # fresh and left fresh on load.
    stateful = [role for role in models if role in optimizers and not _stateless(optimizers[role])]
    for role in stateful:
        sharded[f"{role}_optimizer"] = optimizers[role].sharded_state_dict(sharded[role])
    dist_checkpointing.save(sharded, str(temporary))
    torch.save(rng_states(), temporary / f"rng_rank{global_rank()}.pt")
    if global_rank() == 0:
        torch.save({**trainer_state, OPTIMIZERS_SAVED: stateful}, temporary / TRAINER_STATE)
    barrier()
    if global_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        temporary.rename(final)
        tracker = root / f".{LATEST}.tmp"
        tracker.write_text(final.name)
        tracker.replace(root / LATEST)
        if keep:
            for old in sorted(_complete_steps(root))[:-keep]:
                shutil.rmtree(root / f"step_{old}", ignore_errors=True)
    barrier()
    return final


def _stateless(optimizer: Any) -> bool:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return all(not getattr(o, "optimizer", None) or not o.optimizer.state for o in inner)


def _is_complete(path: Path) -> bool:
    return (path / TRAINER_STATE).is_file() and dist_checkpointing.check_is_distributed_checkpoint(str(path))


def _complete_steps(root: Path) -> list[int]:
    steps = []
    for child in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and _is_complete(child):
            steps.append(int(match.group(1)))
    return steps


def find_resumable(root: str | Path) -> Path | None:
    """The checkpoint named by `latest` if complete, else the newest complete `step_N` (with a warning)."""
    root = Path(root)
    tracker = root / LATEST
    if tracker.is_file():
        named = root / tracker.read_text().strip()
        if _is_complete(named):
            return named
        logger.warning("checkpoint %s named by %s is incomplete; looking for an older one", named, tracker)
    for partial in root.glob(".tmp_step_*") if root.is_dir() else []:
        logger.warning("ignoring %s: a save that did not finish", partial)
    steps = _complete_steps(root)
    return root / f"step_{max(steps)}" if steps else None


def load_checkpoint(path: str | Path, models: dict[str, RoleModel], optimizers: dict[str, Any]) -> dict[str, Any]:
    """Restore models, optimizers and this rank's RNG state; returns the trainer state saved with them."""
    path = Path(path)
    trainer_state = torch.load(path / TRAINER_STATE, weights_only=True)
    saved_optimizers = [role for role in trainer_state.pop(OPTIMIZERS_SAVED) if role in optimizers]
    sharded: dict[str, Any] = {role: model_sharded_state(model, f"{role}.") for role, model in models.items()}
    for role in saved_optimizers:
        sharded[f"{role}_optimizer"] = optimizers[role].sharded_state_dict(sharded[role], is_loading=True)
    state = dist_checkpointing.load(sharded, str(path))
    for role, model in models.items():
        _load_model_state(model, state[role], f"{role}.", strict=True)
    for role in saved_optimizers:
        optimizers[role].load_state_dict(state[f"{role}_optimizer"])
    rng_file = path / f"rng_rank{global_rank()}.pt"
    if rng_file.is_file():
        set_rng_states(torch.load(rng_file, weights_only=True))
    return trainer_state


def rng_states() -> dict[str, Any]:
    """This rank's generators: the host one, the current GPU's (on CUDA), and Megatron's tracked states (the
    tensor- and data-parallel streams that draw dropout and initialisation), tagged with the device they belong to."""
    on_gpu = torch.cuda.is_available()
    states: dict[str, Any] = {"cpu": torch.get_rng_state(), "device": "cuda" if on_gpu else "cpu"}
    if on_gpu:
        states["cuda"] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if tracker.is_initialized():
        states["tracker"] = tracker.get_states()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore `rng_states()`; device-side states only when saved on the same kind of device (a CPU checkpoint
    resumed on GPUs keeps the GPU streams as seeded, and the other way round)."""
    torch.set_rng_state(states["cpu"])
    same_device = states.get("device", "cpu") == ("cuda" if torch.cuda.is_available() else "cpu")
    if same_device and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"])
    if same_device and "tracker" in states:
        tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])


def resolve(path: str | Path) -> Path:
    """`path` if it is a complete checkpoint, else the newest complete one under it (a checkpoint root)."""
    path = Path(path)
    if _is_complete(path):
        return path
    found = find_resumable(path)
    if found is None:
        raise FileNotFoundError(f"{path} is neither a complete checkpoint nor a directory holding one")
    return found


def load_weights(model: RoleModel, path: str | Path, source_role: str, drop: tuple[str, ...] = ()) -> None:
    """Initialise `model` from `source_role`'s weights in a checkpoint (any layout; `path` may be a checkpoint
    root), except keys containing `drop` (the critic takes the actor's trunk but not its vocabulary output)."""
    state = dist_checkpointing.load(model_sharded_state(model, f"{source_role}.", drop), str(resolve(path)))
    _load_model_state(model, state, f"{source_role}.", strict=not drop)
