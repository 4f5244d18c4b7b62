"""Run Megatron-Core on CPU processes (gloo): the one place that bends Megatron towards a machine without CUDA.

`enable_cpu_compat()` is a no-op when CUDA is available (unless asked to hide the GPUs). Without CUDA it
  1. makes `torch.cuda.current_device()` answer 0 and `torch.cuda.synchronize()` do nothing (Megatron allocates
     buffers "on the current device" at ~175 sites and synchronises around p2p calls);
  2. enters a `TorchFunctionMode` that moves every tensor-factory `device=` that names CUDA to the CPU, turns
     `Tensor.cuda()` / `Tensor.to("cuda")` into no-ops, and answers `Tensor.type()` with the CUDA type name for the
     optimizer's and gradient clipping's "torch.cuda.FloatTensor" assertions;
  3. `seed_model_parallel_rng` installs an RNG-states tracker backed by `torch.get/set_rng_state`, so
     `get_cuda_rng_tracker().fork()` (tensor-parallel weight init and dropout) works.
  4. runs the backward of every custom autograd Function under the same mode: the autograd engine does not carry
     a torch-function mode into backward, where Megatron's gathers allocate with `device=torch.cuda.current_device()`
     (the MoE dispatcher's backward does, at EP > 1);
  5. answers `torch.cuda.current_stream()` with a host stand-in whose waits do nothing: megatron-core >= 0.19's
     `_ParamAndGradBucketGroup.start_grad_sync` always asks for the current stream (to wait on CUDA-graph events)
     before every gradient reduction, which raises "Found no NVIDIA driver" without CUDA;
  6. makes Megatron's activation recompute (`tensor_parallel.checkpoint`, full and selective) save and restore no
     CUDA generator state: `_get_cuda_rng_state` answers None and `_set_cuda_rng_state` does nothing, while the host
     generator (which draws dropout on CPU) and the tracker's states (item 3) are saved and restored as on CUDA, so
     the recomputed forward draws the same dropout masks.
  7. lets a caller leave out item 2's mode where Megatron names no CUDA device (`without_device_mode`): the mode
     costs a Python call per torch function, and an asynchronous save's build and plan make thousands of them.
What no stand-in can bring to the CPU (Transformer Engine's kernels and ring attention, the alltoall dispatcher's
CUDA stream) is listed once, in `megatron_ppo/config/gpu_only.py`, and refused there by validation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_ACTIVE_MODE: _CpuDeviceMode | None = None


def _names_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuDeviceMode(TorchFunctionMode):
    """Redirects CUDA placements to the CPU for every torch call made while it is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if not name.startswith("torch.cuda.") else name
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple(a for i, a in enumerate(args) if i == 0 or not _names_cuda(a))
            if len(args) == 1 and not kwargs:
                return args[0]
        return func(*args, **kwargs)


class CpuRNGStatesTracker:
    """Megatron's `CudaRNGStatesTracker` contract (add / fork / get_states / set_states) on the CPU generator."""

    def __init__(self, *_, **__) -> None:
        self.reset()

    def reset(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._is_initialized = False

    def is_initialized(self) -> bool:
        return self._is_initialized

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"RNG state {name!r} or seed {seed} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"RNG state {name!r} was never added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


class _HostStream:
    """`torch.cuda.Stream`'s ordering calls for a process without CUDA, where every operation is already ordered."""

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


@contextlib.contextmanager
def without_device_mode() -> Iterator[None]:
    """Run the body without the CUDA-to-CPU torch-function mode (item 2; a no-op where it is not the innermost mode:
    a CUDA process, or a nested one). Only for code that names no CUDA device: there such a call would fail with
    "Found no NVIDIA driver", not be moved to the CPU. What uses it: a save's sharded state dicts and Megatron's
    asynchronous save planning (`store.save_checkpoint`), which allocate nothing (megatron-core 0.16.1 and 0.19);
    without the mode they take 3.5 and 12.2 ms instead of 6.8 and 20.1 (the tiny recipe, a quiet machine)."""
    if _ACTIVE_MODE is None or torch.overrides._get_current_function_mode() is not _ACTIVE_MODE:
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield


def enable_cpu_compat(hide_gpus: bool = False) -> bool:
    """Make Megatron-Core usable on CPU; returns True if it did anything (False on a CUDA machine).

    `hide_gpus`: a CPU run on a machine with GPUs (`cluster.device=cpu`): `torch.cuda.is_available()` answers
    False in this process from now on, so Megatron and this project take their CPU paths."""
    global _ACTIVE_MODE
    if hide_gpus and torch.cuda.is_available():
        torch.cuda.is_available = lambda: False
    if torch.cuda.is_available():
        return False
    if _ACTIVE_MODE is None:
        torch.cuda.current_device = lambda: 0
        torch.cuda.synchronize = lambda device=None: None
        torch.cuda.current_stream = lambda device=None: _HOST_STREAM
        _ACTIVE_MODE = _CpuDeviceMode()
        _ACTIVE_MODE.__enter__()
        _backward_under_cpu_mode()
        _recompute_without_cuda_generator()
    return True


def _backward_under_cpu_mode() -> None:
    from torch.autograd.function import BackwardCFunction

    apply = BackwardCFunction.apply

    def apply_on_cpu(self, *args):
        with _CpuDeviceMode():
            return apply(self, *args)

    BackwardCFunction.apply = apply_on_cpu


def _recompute_without_cuda_generator() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *args, **kwargs: None
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None


def seed_model_parallel_rng(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """CPU twin of `model_parallel_cuda_manual_seed`: the same seeds per tracker name, kept on the CPU generator."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
