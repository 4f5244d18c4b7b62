"""Checkpoints' contents: Megatron `dist_checkpointing` for models and optimizers, this rank's RNG states, and the
trainer's own state — written as `directory.py` lays a run's checkpoints out (`.tmp_step_N` → `step_N` → `latest`).

Loading goes through Megatron's sharded state dicts, so a checkpoint saved at one TP/PP layout loads at another.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import ShardedBase
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_ppo.checkpoint import directory, verify
from megatron_ppo.checkpoint.async_save import AsyncSaves
from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.models import RoleModel, unwrap
from megatron_ppo.models.gpt import sync_parameters
from megatron_ppo.models.lora import ADAPTER_KEYS, is_adapter
from megatron_ppo.parallel.collectives import any_rank, barrier, global_rank
from megatron_ppo.parallel.cpu_compat import without_device_mode
from megatron_ppo.parallel.megatron_compat import (
    async_save_request,
    checkpoint_writes_in_process,
    constant_structure_save_strategy,
    writing_first_in_the_writer,
)

OPTIMIZERS_SAVED = "checkpoint/optimizers_saved"
# Transformer Engine modules' FP8 metadata: a local-spec checkpoint (made on CPU, or converted) has none of it
EXTRA_STATE = "_extra_state"
# How the distributed optimizer's states are written: each rank's own buffer shards as they are, no gather
# (Megatron-LM's default); such a checkpoint reloads its optimizer states at the same TP/PP (any DP). Megatron's
# default for this argument, `fully_sharded_model_space`, writes flattened-range tensors its own checkpointing
# refuses ("ShardedTensor.flattened_range is not supported"), and `fully_reshardable` fails to load over torch's
# Adam (its per-parameter `step` is not in the file: KeyError) — both in megatron-core 0.16 and 0.19.
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}
# The distributed optimizer's buffer keys name no parameter; saved under the role's prefix (`_optimizer_sharded_state`)
DISTRIBUTED_OPTIMIZER_KEY = "optimizer.distributed."
# What says which parameter group a saved one is (megatron-core's group identifiers less the schedule's rates:
# decay or not, expert or not, a decoupled rate); a saved group keeps only what the checkpoint owns (`SAVED_IN_GROUP`:
# its parameters, Adam's step count, and the rate and decay the schedule had set at the saved step — the schedule,
# loaded after, sets them again from the config's values)
GROUP_ROLE_KEYS = ("wd_mult", "lr_mult", "is_expert_parallel", "is_decoupled_lr", "optimizer")
SAVED_IN_GROUP = ("params", "step", "lr", "weight_decay")


def model_sharded_state(model: RoleModel, prefix: str, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    """The role's sharded state dict (one entry per virtual-pipeline chunk), keys prefixed, `drop` keys removed."""
    state = {}
    for index, chunk in enumerate(model.chunks):
        chunk_state = unwrap(chunk).sharded_state_dict(prefix=prefix)
        state[f"model{index}"] = {k: v for k, v in chunk_state.items() if not any(d in k for d in drop)}
    return state


def _load_model_state(
    model: RoleModel, state: dict[str, Any], prefix: str, strict: bool, fresh_adapters: bool = False
) -> None:
    """Load `state` into the model's chunks; `strict`: every weight must be there (a missing `*_extra_state`, which
    a local-spec checkpoint never wrote, keeps the module's own; with `fresh_adapters`, LoRA adapters keep their
    initialisation)."""
    for index, chunk in enumerate(model.chunks):
        chunk_state = {key.removeprefix(prefix): value for key, value in state[f"model{index}"].items()}
        result = unwrap(chunk).load_state_dict(chunk_state, strict=False)
        missing = [key for key in result.missing_keys
                   if not key.endswith(EXTRA_STATE) and not (fresh_adapters and is_adapter(key))]  # fmt: skip
        if strict and (missing or result.unexpected_keys):
            raise verify.CheckpointError(
                f"the {model.role} model's chunk {index} does not match the checkpoint: missing {missing}, "
                f"unexpected {result.unexpected_keys}; load a checkpoint of this model's architecture"
            )


def _load_sharded(sharded: dict[str, Any], path: Path) -> dict[str, Any]:
    """`dist_checkpointing.load` of `sharded` from `path`. Keys `sharded` asks for that the checkpoint lacks are
    refused by name, except Transformer Engine's `*_extra_state` (a local-spec checkpoint loaded into a TE model:
    TE starts its FP8 metadata fresh)."""
    with verify.reading(path, "the models' and optimizers' shards"):
        state, _, absent = dist_checkpointing.load(sharded, str(path), strict=StrictHandling.RETURN_UNEXPECTED)
    lacking = sorted(key for key in absent if not key.endswith(EXTRA_STATE))
    if lacking:
        shown = ", ".join(lacking[:8]) + (f" and {len(lacking) - 8} more" if len(lacking) > 8 else "")
        raise verify.CheckpointError(
            f"{path} lacks {len(lacking)} of the entries this run needs ({shown}): it holds another architecture "
            "(model.* keys) or other roles; load a checkpoint saved with this model"
        )
    return state


class SavePlans:
    """Megatron's save strategy kept across a run's saves while what they shard stays the same, so that only the
    first save of a structure pays for Megatron's checks and plan exchange: Megatron-LM's
    `--ckpt-assume-constant-structure` (a `constant_structure_save_strategy` kept in its checkpointing context, and
    `validate_access_integrity` only on its first save), with the structure checked here instead of assumed — the
    actor's optimizer has no state before its first step (the critic's warm-up), and a plan cached for another
    structure would write the wrong shards. Held by whoever saves repeatedly (`CheckpointKeeper`)."""

    def __init__(self) -> None:
        self.strategy: Any = None
        self.structure: int | None = None

    def for_save(self, sharded: dict[str, Any]) -> tuple[Any, bool]:
        """(the strategy to save `sharded` with, whether Megatron must validate its sharding): a fresh strategy, to
        validate, when this is the first save or any rank's structure differs from its last save's (collective:
        one flag all-reduced, so that every rank takes the same path through Megatron's collectives; it is also
        the barrier after which the ranks write into the directory rank 0 made)."""
        structure = _structure(sharded)
        changed = any_rank(self.strategy is None or structure != self.structure)
        if changed:
            self.strategy, self.structure = constant_structure_save_strategy(), structure
        return self.strategy, changed


# What Megatron plans a save from, of each shard (not its values)
_PLANNED = ("global_shape", "global_offset", "axis_fragmentations", "replica_id", "dtype", "flattened_range")


def _structure(sharded: dict[str, Any]) -> int:
    """A digest of this rank's shards as Megatron plans them: each one's kind, key, place in its global tensor,
    replica, dtype and local shape, in order (compared within this process only)."""
    leaves = []
    for value in nested_values(sharded):
        if isinstance(value, ShardedBase):
            data = getattr(value, "data", None)
            shape = tuple(data.shape) if isinstance(data, torch.Tensor) else None
            leaves.append((type(value).__name__, value.key, shape, *(str(getattr(value, n, None)) for n in _PLANNED)))
    return hash(tuple(leaves))


def save_checkpoint(
    root: str | Path,
    step: int,
    models: dict[str, RoleModel],
    optimizers: dict[str, Any],
    trainer_state: dict[str, Any],
    run: RunIdentity | None = None,
    keep: int | None = None,
    protect: Sequence[str | Path] | Callable[[], Sequence[str | Path]] = (),
    saves: AsyncSaves | None = None,
    plans: SavePlans | None = None,
) -> Path:
    """Save models (and their optimizers) under their role names, `trainer_state` (plain Python/tensors) and the
    identity of the `run` saving them (None: an initialisation, such as the SFT start, that no run resumes).

    With `keep`, the run's own checkpoints beyond the newest `keep` are then set aside and deleted (`directory.prune`
    and `delete_discarded`; a step saved again replaces its old checkpoint the same way), except
    those in `protect` (the best evaluation's, which an evaluation-drop rollback returns to, and the good one a guard
    rollback returns to; a callable is asked when the checkpoint is published). Each model's pending
    distributed-optimizer parameter all-gather is finished first (`sync_parameters`), so what is written is the last
    step's weights on every rank. `plans`: Megatron's save strategy kept from the previous saves (`SavePlans`).

    With `saves`, the shards are written in the background (`async_save.py`): this returns once they are handed to
    the writers, and the checkpoint is published (renamed to `step_N`, named in `latest`, older ones pruned) when
    `saves` finalises it. The returned path is where it will be. The small files (this rank's RNG states; rank 0's
    trainer state and run identity) are then written by the writer too, before its shards; rank 0's writer first
    deletes what earlier publications set aside (the keeper's `close` deletes what the last ones did).

    A write that fails on any rank ends in the same `CheckpointError` on every rank (`verify.writing`: Megatron's
    writers' failures are raised on every rank by its finalisation; `verify.writing_on_every_rank` for the files
    some ranks write alone), so that no rank waits in a collective for one that failed."""
    if keep and run is None:
        raise ValueError("pruning (keep) needs the run identity: only a run's own checkpoints are pruned")
    started = time.perf_counter()
    root = Path(root)
    final, temporary = root / f"step_{step}", root / f".tmp_step_{step}"
    if global_rank() == 0:  # the other ranks write into it after the next collective (`plans`' or a barrier)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir(parents=True)
    for model in models.values():
        sync_parameters(model)
    # An optimizer that has not stepped yet (the actor during critic warm-up) has no state: it is recorded as
    # fresh and left fresh on load.
    stateful = [role for role in models if role in optimizers and not _stateless(optimizers[role])]
    with without_device_mode():  # (on CPU processes) nothing in the build names a CUDA device
        sharded = _sharded_state(models, optimizers, stateful)
    if plans is not None:
        strategy, validate = plans.for_save(sharded)
    else:
        barrier()
        strategy, validate = None, True
    # on the host: a process forked from a CUDA one (the asynchronous writer) must not touch the device
    rng, trainer_state = _on_host(rng_states()), _on_host(trainer_state)

    rank = global_rank()
    own_files: list[Path] = []

    def write_own_files() -> None:
        own_files.append(temporary / f"rng_rank{rank}.pt")
        torch.save(rng, own_files[-1])
        if rank == 0:
            own_files.append(temporary / directory.TRAINER_STATE)
            torch.save({**trainer_state, OPTIMIZERS_SAVED: stateful}, own_files[-1])
            if run is not None:
                own_files.append(run.write(temporary))

    def write_in_the_writer() -> None:
        if rank == 0:  # what earlier publications set aside, first: the space it frees
            directory.delete_discarded(root)
        write_own_files()

    def digest_in_the_writer(shards: list[Path]) -> None:
        verify.write_digests(temporary, [*own_files, *shards], rank)

    request = None
    with verify.writing(temporary, step):  # Megatron's plan and writers fail on every rank at once
        if saves is None:
            checkpoint_writes_in_process()
            dist_checkpointing.save(sharded, str(temporary), sharded_strategy=strategy,
                                    validate_access_integrity=validate)  # fmt: skip
        else:
            with without_device_mode():  # Megatron's asynchronous plan names no CUDA device either
                request = async_save_request(sharded, str(temporary), strategy, validate)
            # Rank 0's save looked for files in the directory first ("Overwriting old incomplete / corrupted
            # checkpoint" where it found some); with a cached plan nothing inside Megatron's save waits for it, so
            # no rank writes its own files before it has looked
            barrier()
            request = writing_first_in_the_writer(request, write_in_the_writer, digest_in_the_writer)

    def publish() -> None:
        # every rank's files are written (the agreement after them, or Megatron's finalisation); the agreement
        # below is the barrier after rank 0's renames
        with verify.writing_on_every_rank(temporary, step):
            if global_rank() == 0:
                verify.write_manifest(temporary)  # last: every rank's files are written
                replaced = root / f"{directory.REPLACED_PREFIX}{final.name}"
                if final.exists():  # `latest` may name it (a step saved again after a rollback): kept until replaced
                    directory.discard(replaced)
                    final.rename(replaced)
                temporary.rename(final)
                directory.point_latest_at(final)
                directory.discard(replaced)
                if keep:
                    spared = protect() if callable(protect) else protect
                    directory.prune(root, run.run_id, keep, step, [Path(p) for p in spared])
                if saves is None:  # an asynchronous save leaves the deleting to the next writer (or `close`)
                    directory.delete_discarded(root)

    if request is None:  # a synchronous save: the shards' digests are the manifest's (rank 0)
        with verify.writing_on_every_rank(temporary, step):
            write_own_files()
            verify.write_digests(temporary, own_files, rank)
        publish()
    else:
        request.add_finalize_fn(publish)
        saves.schedule(request, step, final, started)
    return final


def _sharded_state(models: dict[str, RoleModel], optimizers: dict[str, Any], stateful: list[str]) -> dict[str, Any]:
    """The models' sharded state dicts under their roles, and the `stateful` roles' optimizers' beside them."""
    sharded: dict[str, Any] = {role: model_sharded_state(model, f"{role}.") for role, model in models.items()}
    for role in stateful:
        sharded[f"{role}_optimizer"] = _optimizer_sharded_state(optimizers[role], sharded[role], role)
    return sharded


def _on_host(value: Any) -> Any:
    """`value` (nested dicts, lists and tuples) with every tensor in host memory (a tensor already there as is)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {key: _on_host(item) for key, item in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_on_host(item) for item in value)
    return value


def _optimizer_sharded_state(optimizer: Any, model_state: dict[str, Any], role: str, loading: bool = False) -> Any:
    """The role's optimizer state as sharded objects (`OPTIMIZER_METADATA`'s format). The distributed optimizer's
    buffer keys (`[chained_N.]optimizer.distributed.…`) name no parameter, so they get the role's prefix: the
    actor's and the critic's would be one key otherwise."""
    state = optimizer.sharded_state_dict(model_state, is_loading=loading, metadata=OPTIMIZER_METADATA)

    def under_role(item: Any) -> Any:
        if isinstance(item, ShardedBase) and DISTRIBUTED_OPTIMIZER_KEY in item.key:
            item.key = f"{role}.{item.key}"
        return item

    dict_list_map_inplace(under_role, state)
    return state


def _allocate_distributed_optimizer_states(optimizer: Any) -> None:
    """Give a distributed optimizer that has not stepped (a resume's fresh one) its states for the load to fill:
    over torch's Adam (no Apex or TE: every CPU run) its `state_dict()` reads one `step` from the states and fails
    on none (megatron-core 0.16 and 0.19). Megatron's own dummy step on zero gradients allocates them; the load
    then overwrites every value it wrote (main weights, moments, step)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _restore_adam_steps(optimizer: Any) -> None:
    """Give every parameter of a distributed optimizer over torch's Adam its own step count, the checkpoint's.

    Megatron keeps torch Adam's per-parameter `step` in the param groups of the checkpoint and sets it back from
    there, but its `dp_reshardable` parameter state then copies each parameter's states over it, `step` included,
    and that `step` is never read from the checkpoint: what was allocated before the load (1) wins, and all the
    parameters share that one tensor, which Adam increments once per parameter and step (megatron-core 0.16 and
    0.19). A wrong step is a wrong bias correction: the first update after a resume differed from the
    uninterrupted one by ~1 % of the weights (tests/distributed/test_checkpoints.py)."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if not isinstance(inner, DistributedOptimizer):
            continue
        for group in inner.optimizer.param_groups:
            for param in group["params"]:
                state = inner.optimizer.state.get(param)
                if state is not None and "step" in state and "step" in group:
                    state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _stateless(optimizer: Any) -> bool:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return all(not getattr(o, "optimizer", None) or not o.optimizer.state for o in inner)


def load_checkpoint(path: str | Path, models: dict[str, RoleModel], optimizers: dict[str, Any]) -> dict[str, Any]:
    """Restore models, optimizers and this rank's RNG state; returns the trainer state saved with them."""
    path = Path(path)
    with verify.reading(path, directory.TRAINER_STATE):
        trainer_state = torch.load(path / directory.TRAINER_STATE, weights_only=True)
    saved_optimizers = [role for role in trainer_state.pop(OPTIMIZERS_SAVED) if role in optimizers]
    sharded: dict[str, Any] = {role: model_sharded_state(model, f"{role}.") for role, model in models.items()}
    for role in saved_optimizers:
        _allocate_distributed_optimizer_states(optimizers[role])
        sharded[f"{role}_optimizer"] = _optimizer_sharded_state(optimizers[role], sharded[role], role, loading=True)
    state = _load_sharded(sharded, path)
    for role, model in models.items():
        _load_model_state(model, state[role], f"{role}.", strict=True)
    for role in saved_optimizers:
        _take_current_settings(optimizers[role], state[f"{role}_optimizer"])
        with torch.no_grad():  # megatron-core copies into the main weights without it: with fp32 weights under
            optimizers[role].load_state_dict(state[f"{role}_optimizer"])  # the DO those are views of leaves
        _restore_adam_steps(optimizers[role])
    rng_file = path / f"rng_rank{global_rank()}.pt"
    if rng_file.is_file():
        with verify.reading(path, rng_file.name):
            set_rng_states(torch.load(rng_file, weights_only=True))
    return trainer_state


def _group_role(group: dict[str, Any]) -> tuple:
    """Which parameter group this is, whatever the rates: its `GROUP_ROLE_KEYS` (None where it has none)."""
    return tuple(group.get(key) for key in GROUP_ROLE_KEYS)


def _take_current_settings(optimizer: Any, saved: Any) -> None:
    """The saved optimizer state's parameter groups take every setting of the current groups (`max_lr`, `min_lr`,
    Adam's betas and ε, …) and keep only `SAVED_IN_GROUP`: a run resumed with another `optim.*` trains with the
    config's, as verl does (`use_checkpoint_opt_param_scheduler: false`, its default). megatron-core 0.19 looks a
    saved group up by its `max_lr`/`min_lr` and stopped the load when `optim.lr` had changed ("Could not find parameter
    group with key"); before, the saved values replaced the config's without a word. Groups are matched by
    `_group_role`; a role two current groups share with different settings is left as saved."""
    settings: dict[tuple, dict[str, Any] | None] = {}
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in getattr(getattr(inner, "optimizer", None), "param_groups", []):
            current = {key: value for key, value in group.items() if key not in SAVED_IN_GROUP}
            role = _group_role(group)
            settings[role] = current if settings.get(role, current) == current else None

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "param_groups" and isinstance(value, list):
                    for group in value:
                        if isinstance(group, dict) and (current := settings.get(_group_role(group))):
                            group.update(current)
                else:
                    visit(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                visit(value)

    visit(saved)


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


def load_weights(model: RoleModel, path: str | Path, source_role: str, drop: tuple[str, ...] = (),
                 adapters: bool = False) -> None:  # fmt: skip
    """Initialise `model` from `source_role`'s weights in a checkpoint (any layout; `path` may be a checkpoint
    root), except keys containing `drop` (the critic takes the actor's trunk but not its vocabulary output). A LoRA
    model's adapters are read with `adapters` (the trained model, as `convert verify` compares it), and otherwise
    not: initial weights are the base they start on (resuming reads them: `load_checkpoint`)."""
    asked = model_sharded_state(model, f"{source_role}.", drop if adapters else (*drop, *ADAPTER_KEYS))
    state = _load_sharded(asked, directory.resolve(path))
    _load_model_state(model, state, f"{source_role}.", strict=not drop, fresh_adapters=not adapters)
