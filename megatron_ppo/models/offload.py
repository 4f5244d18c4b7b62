"""Host offload between the phases of a PPO iteration (verl's `param_offload`, `grad_offload`, `optimizer_offload`
under each role's `megatron` section).

What a role holds on its device, by kind:
    params     the model's weights: Megatron DDP's contiguous `param_data` buffers (distributed optimizer) or the
               parameters' own storages, and the frozen reference's parameters
    grads      DDP's contiguous fp32 `grad_data` buffers (every `param.main_grad` is a view into them)
    optimizer  the fp32 main parameters (`fp32_from_float16_groups` / `shard_fp32_from_float16_groups`: the
               torch optimizer's own params, where they are not views of the weights) and every tensor of the Adam
               state (`exp_avg`, `exp_avg_sq`, `step`)
Each phase (`megatron_ppo.phases.PHASE_NEEDS`) says which kinds each role needs; a role keeps those, plus every kind
whose switch is off, and the rest leaves the device (`phases.resident_kinds`, which the planner's memory count
shares).

How (as verl's `offload_megatron_model_to_cpu`): every distinct device storage of the kind is copied into a host
buffer (pinned on CUDA) and resized to 0 bytes, so the device memory is returned while every tensor, view and
optimizer-state key keeps its identity; coming back, the storage is resized and the bytes copied in. Gradients are
not copied: each update starts by zeroing them, so they are dropped and come back as zeros. On CPU the host copy is
a second CPU buffer, which makes the bookkeeping (storages emptied and refilled) testable without a GPU.
A tensor must not be touched while its storage is offloaded (reading it is undefined: the storage has no bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from megatron.core.distributed import DistributedDataParallel

from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models.gpt import RoleModel, sync_parameters
from megatron_ppo.parallel.device import current_device
from megatron_ppo.planner.phases import OFFLOAD_KINDS, PHASE_NEEDS, Phase, offload_switches, resident_kinds


@dataclass
class _Stash:
    """One offloaded device storage and its bytes on the host (None for gradients, which come back as zeros)."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None


@dataclass
class RoleResidency:
    """One role's model, optimizer (None for the reference), offload switches, and what is on the host now."""

    model: RoleModel
    optimizer: object | None
    layout: MegatronConfig
    stashed: dict[str, list[_Stash]] = field(default_factory=dict)  # kind → its offloaded storages


class HostOffload:
    """Places each role's params, grads and optimizer states for a phase: `enter(phase)` before it runs.

    `report(line)` receives one line per phase entered when any role offloads anything: the bytes each role keeps
    on its device, by kind. `resident_bytes` measures them from the tensors themselves."""

    def __init__(
        self,
        roles: dict[str, tuple[RoleModel, object | None, MegatronConfig]],
        report: Callable[[str], None] | None = None,
    ) -> None:
        self.roles = {
            role: RoleResidency(model, optimizer, layout) for role, (model, optimizer, layout) in roles.items()
        }
        self.report = report
        self.enabled = any(any(offload_switches(r.layout).values()) for r in self.roles.values())

    def enter(self, phase: Phase) -> dict[str, dict[str, int]]:
        """Move every role's kinds to where `phase` wants them: first what leaves the device, then what comes back
        (so the peak of the move is the phase's own). Returns the resident bytes, role → kind → bytes."""
        if phase not in PHASE_NEEDS:
            raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASE_NEEDS)}")
        if self.enabled:
            wanted = {role: resident_kinds(phase, role, r.layout) for role, r in self.roles.items()}
            for role, residency in self.roles.items():
                for kind in OFFLOAD_KINDS:
                    if kind not in wanted[role] and kind not in residency.stashed:
                        _offload(residency, kind)
            for role, residency in self.roles.items():
                for kind in OFFLOAD_KINDS:
                    if kind in wanted[role] and kind in residency.stashed:
                        _load(residency, kind)
        resident = {role: self.resident_bytes(role) for role in self.roles}
        if self.enabled and self.report is not None:
            self.report(f"{phase}: " + "; ".join(_describe(role, kinds) for role, kinds in resident.items()))
        return resident

    def holds(self, role: str, kind: str) -> bool:
        """Whether `role`'s `kind` is on its device now (not offloaded)."""
        return kind not in self.roles[role].stashed

    def resident_bytes(self, role: str) -> dict[str, int]:
        """Bytes of `role`'s distinct storages of each kind that hold memory on its device now."""
        residency = self.roles[role]
        return {kind: sum(s.nbytes() for s in _storages(residency, kind)) for kind in OFFLOAD_KINDS}


def _offload(residency: RoleResidency, kind: str) -> None:
    if kind == "params":
        sync_parameters(residency.model)  # a distributed-optimizer all-gather may still be writing the weights
    stashes = []
    for storage in _storages(residency, kind):
        if not storage.resizable():
            raise RuntimeError(f"the {residency.model.role} model's {kind} live in a storage that cannot be resized "
                               "(not allocated by torch); turn the role's offload switches off")  # fmt: skip
        nbytes = storage.nbytes()
        host = None
        if kind != "grads":
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_as_bytes(storage))
        storage.resize_(0)
        stashes.append(_Stash(storage, nbytes, host))
    residency.stashed[kind] = stashes


def _load(residency: RoleResidency, kind: str) -> None:
    stashes = residency.stashed.pop(kind)  # held until the copies below have finished
    for stash in stashes:
        stash.storage.resize_(stash.nbytes)
        data = _as_bytes(stash.storage)
        if stash.host is None:
            data.zero_()
        else:
            data.copy_(stash.host, non_blocking=True)
    if stashes and stashes[0].storage.device.type == "cuda":
        torch.cuda.current_stream().synchronize()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storages(residency: RoleResidency, kind: str) -> list[torch.UntypedStorage]:
    """The distinct storages holding device memory behind `kind`'s tensors (a storage shared with the weights,
    e.g. fp32 main params that are views of them, counts as params only)."""
    device = current_device()
    weights = {s.data_ptr() for s in _unique(_param_tensors(residency.model), device)}
    tensors = {"params": _param_tensors, "grads": _grad_tensors, "optimizer": _optimizer_tensors}[kind]
    source = residency.model if kind != "optimizer" else residency.optimizer
    found = _unique(tensors(source) if source is not None else [], device)
    return found if kind == "params" else [s for s in found if s.data_ptr() not in weights]


def _unique(tensors: Iterable[torch.Tensor], device: torch.device) -> list[torch.UntypedStorage]:
    """The distinct storages on `device` (the run's) that hold memory now; host-side state (Adam's `step` on the
    CPU in a CUDA run) stays where it is."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.nbytes() > 0 and storage.device.type == device.type:
            seen.setdefault(storage.data_ptr(), storage)
    return list(seen.values())


def _ddp_buffers(model: RoleModel) -> Iterator:
    for chunk in model.chunks:
        if isinstance(chunk, DistributedDataParallel):
            yield from chunk.buffers
            yield from chunk.expert_parallel_buffers


def _param_tensors(model: RoleModel) -> Iterator[torch.Tensor]:
    for chunk in model.chunks:
        yield from chunk.parameters()
    for buffer in _ddp_buffers(model):
        if buffer.param_data is not None:
            yield buffer.param_data


def _grad_tensors(model: RoleModel) -> Iterator[torch.Tensor]:
    for buffer in _ddp_buffers(model):
        yield buffer.grad_data


def _optimizer_tensors(optimizer) -> Iterator[torch.Tensor]:
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        torch_optimizer = getattr(inner, "optimizer", None)
        if torch_optimizer is None:  # a rank that holds no parameter of this optimizer
            continue
        for group in torch_optimizer.param_groups:
            yield from group["params"]
        for state in torch_optimizer.state.values():
            yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _describe(role: str, kinds: dict[str, int]) -> str:
    return f"{role} " + ", ".join(f"{kind} {_size(nbytes)}" for kind, nbytes in kinds.items())


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"
