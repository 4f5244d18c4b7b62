"""The one device decision of a run, made at start from `cluster.device`, and the moves it implies.

After `select_device`, `on_cuda()` is the answer every other module uses: models are built on this process's GPU,
micro-batches move there (dense, pinned, `non_blocking`: `host_copy`), and only metrics come back to the host. On CPU
the compatibility layer (`cpu_compat`) is active, also on a machine that has GPUs but was told `cluster.device=cpu`:
there it hides them, so nothing lands on a GPU half-way through a CPU run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.parallel.cpu_compat import enable_cpu_compat

logger = logging.getLogger(__name__)
DEVICES = ("cuda", "cpu")
# One hardware work queue per CUDA context, so kernels start in the order they are issued: Megatron's TP/SP/CP
# communication overlap relies on it (a collective issued before a GEMM starts before it). Megatron-LM refuses
# TP > 1 or CP > 1 without it (before Blackwell); megatron-core itself never sets it.
CUDA_MAX_CONNECTIONS = ("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def set_cuda_max_connections(environ: MutableMapping[str, str] = os.environ) -> str:
    """`CUDA_DEVICE_MAX_CONNECTIONS=1` unless the user set it (their value is kept); returns the value in force.
    The driver reads it when the process's CUDA context is created, so this runs before the first
    `torch.cuda.set_device` (`select_device`); `slurm/ppo.sbatch` exports it for the whole job as well."""
    name, value = CUDA_MAX_CONNECTIONS
    return environ.setdefault(name, value)


def select_device(requested: str, local_rank: int) -> torch.device:
    """This process's device for `cluster.device=requested`.

    cuda: refused where no GPU is visible (with the fix); otherwise GPU `local_rank`, made current (with
    `CUDA_DEVICE_MAX_CONNECTIONS=1` unless set, before the context exists: `set_cuda_max_connections`).
    cpu: the CPU compatibility layer; where GPUs are visible, a warning names the key that would use them. The
    variable is set there too, unless the user set it: it has no effect without a CUDA context, and Megatron's
    tensor-parallel layers warn that it is unset.
    """
    if requested not in DEVICES:
        raise ConfigError([f"cluster.device={requested!r} is not one of {', '.join(map(repr, DEVICES))}"])
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "cuda":
        if visible == 0:
            raise ConfigError(
                ["cluster.device='cuda', but this machine shows no CUDA GPU (torch.cuda.is_available() is False, "
                 f"torch {torch.__version__}, CUDA build {torch.version.cuda}); run on a GPU node, install a CUDA "
                 "build of PyTorch, or set cluster.device=cpu (e.g. compose configs/clusters/cpu)"]
            )  # fmt: skip
        if local_rank >= visible:
            raise ConfigError(
                [f"local rank {local_rank} has no GPU: only {visible} visible; set cluster.gpus_per_node <= {visible} "
                 "or check CUDA_VISIBLE_DEVICES"]
            )  # fmt: skip
        set_cuda_max_connections()
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if visible:
        logger.warning(
            "cluster.device='cpu' on a machine with %d visible GPU(s): running on the CPU with gloo and the GPUs "
            "hidden; set cluster.device=cuda to use them",
            visible,
        )
    enable_cpu_compat(hide_gpus=True)
    set_cuda_max_connections()  # no CUDA context here; Megatron's layers warn on every rank while it is unset
    return torch.device("cpu")


def on_cuda() -> bool:
    """True when this process computes on a GPU (after `select_device`; before it, whether CUDA is available)."""
    return torch.cuda.is_available()


def current_device() -> torch.device:
    """The device models and micro-batches live on."""
    return torch.device("cuda", torch.cuda.current_device()) if on_cuda() else torch.device("cpu")


# Below this size a host tensor goes to the GPU from pageable memory: pinning it costs a page-locked allocation and a
# copy, more than the few microseconds an overlapped copy of a few kilobytes saves. Larger ones are pinned; torch's
# caching host allocator hands a freed pinned block to the next pin of its size, so a run's same-shaped micro-batches
# reuse their pinned buffers (it records the copy's stream, so a block is reused only once its copy has ended).
PIN_MIN_BYTES = 64 * 1024


def to_device(batch: Mapping[str, Any], device: torch.device, where: str) -> dict[str, Any]:
    """`batch` with every host tensor copied to `device` (`host_copy`): pinned and copied with `non_blocking=True`
    to a GPU, so the copy overlaps with the kernels already queued; on the CPU through the same staging, so the rule
    pinning enforces holds there too. A tensor on another accelerator (another GPU, the meta device) is refused
    rather than moved: it means a part of the run decided the device on its own."""
    strays = {
        k: str(v.device)
        for k, v in batch.items()
        if isinstance(v, torch.Tensor) and v.device.type != "cpu" and v.device != device
    }
    if strays:
        raise RuntimeError(
            f"{where}: micro-batch tensors {strays} are on another device than the model ({device}); build batches "
            "on the host (run_micro_batches moves them) or on the device from megatron_ppo.parallel.device."
            "current_device()"
        )
    return {
        key: host_copy(value, device) if isinstance(value, torch.Tensor) and value.device.type == "cpu" else value
        for key, value in batch.items()
    }


def host_copy(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor of any layout (expanded, overlapping, strided, 0-d) on `device`.

    Pinning copies into a page-locked buffer of the same sizes *and strides* (`at::_pin_memory`: storage for the
    strides, then `copy_`), which an expanded or self-overlapping tensor (`arange(n).expand(b, n)`: stride 0) cannot
    fill — torch refuses with "more than one element of the written-to tensor refers to a single memory location".
    So the layout is made dense first. To a GPU: at least `PIN_MIN_BYTES` pinned, then copied without blocking;
    smaller ones copied from pageable memory. On the CPU the pinned buffer's stand-in, a plain buffer of the same
    strides, is filled the same way, so a layout CUDA would refuse fails here too, and the caller gets a copy as it
    would from a GPU."""
    dense = value.contiguous()
    if device.type != "cuda":
        return torch.empty_strided(dense.size(), dense.stride(), dtype=dense.dtype, device=device).copy_(dense)
    if dense.numel() * dense.element_size() < PIN_MIN_BYTES:
        return dense.to(device, non_blocking=True)
    return dense.pin_memory().to(device, non_blocking=True)


def require_on_device(tensors: Mapping[str, Any], where: str) -> None:
    """Refuse tensors that are not on the run's device (`current_device()`), naming the fix: what reaches `algo/`
    is on one device whoever calls — the trainer moves its batch once (`to_device`), and a caller that builds a
    batch of its own must move it the same way (a host batch would meet device tensors in the first sum)."""
    device = current_device()
    off = {key: str(value.device) for key, value in tensors.items()
           if isinstance(value, torch.Tensor) and value.device != device}  # fmt: skip
    if off:
        raise ValueError(
            f"{where}: tensors {off} are not on this run's device ({device}); move the batch first: "
            f"megatron_ppo.parallel.device.to_device(batch, current_device(), ...)"
        )


def module_device(module: torch.nn.Module, where: str) -> torch.device:
    """The device of `module`'s parameters, checked against this run's device (`current_device()`)."""
    devices = {p.device for p in module.parameters()}
    expected = current_device()
    if devices != {expected}:
        raise RuntimeError(
            f"{where}: parameters on {sorted(map(str, devices))}, but this run computes on {expected}; build models "
            "with megatron_ppo.models.build_role_model after init_distributed (it places them on the run's device)"
        )
    return expected
