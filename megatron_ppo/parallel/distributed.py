"""Process groups for a run: torch.distributed from torchrun or Slurm variables, then Megatron's parallel_state."""

from __future__ import annotations

import itertools
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron_ppo.config.errors import UserError
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.parallel.cpu_compat import seed_model_parallel_rng
from megatron_ppo.parallel.device import select_device
from megatron_ppo.parallel.launch_env import ANY_FREE_PORT, DistEnv, dist_env_from_environment
from megatron_ppo.parallel.megatron_compat import bind_missing_te_general_gemm

_STARTS = itertools.count()  # process-group starts in this process (several runs may follow each other in one)


# What a start says when its rendezvous port is taken (`bench/ports.py` launches again on another port on it)
PORT_IN_USE = "(MASTER_PORT) is already in use"


class LaunchError(UserError):
    """The processes cannot start as launched (a port taken, ...); the message says how to launch instead."""


def _rendezvous_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The job's store: torch's tcp:// rendezvous at MASTER_ADDR:MASTER_PORT, or for a single process without a
    port (`launch_env.ANY_FREE_PORT`) a store bound to a port the OS picks (torch 2.6's rendezvous refuses port 0)."""
    if env.world_size == 1 and env.master_port == ANY_FREE_PORT:
        return dist.TCPStore(env.master_addr, ANY_FREE_PORT, 1, True, timeout=timeout)
    address = f"tcp://{env.master_addr}:{env.master_port}"
    store, _, _ = next(dist.rendezvous(address, rank=env.rank, world_size=env.world_size, timeout=timeout))
    return store


def init_distributed(layout: MegatronConfig, seed: int, timeout_s: float = 600.0, device: str | None = None) -> DistEnv:
    """Decide the device (`cluster.device`; None: CUDA when available), start torch.distributed (NCCL bound to this
    process's GPU on CUDA, gloo on CPU), then Megatron's TP/PP/VPP/CP/DP/EP groups, then seed.

    Seeding follows Megatron: the data-parallel RNG state gets `seed`, the tensor-parallel one `seed + 2718 + tp_rank`,
    the expert-parallel one `seed + 1024 + 100·ep_rank + expert_tp_rank`.
    """
    env = dist_env_from_environment()
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    chosen = select_device(device, env.local_rank)
    bind_missing_te_general_gemm()  # on either device: MoE routers read the name
    if not dist.is_initialized():
        try:
            store = _rendezvous_store(env, timedelta(seconds=timeout_s))
        except RuntimeError as error:  # torch's DistNetworkError
            if "EADDRINUSE" not in str(error) and "address already in use" not in str(error).lower():
                raise
            raise LaunchError(
                f"port {env.master_port} on {env.master_addr} {PORT_IN_USE}, by another run or "
                "program, so this process cannot start its process group: set another free port, or leave "
                "MASTER_PORT unset for a single process (it then takes one the OS picks), or launch with "
                "`torchrun --standalone` (it picks one)"
            ) from None
        dist.init_process_group(
            backend="nccl" if chosen.type == "cuda" else "gloo",
            # torch names groups by a counter that a teardown resets, and the launcher's store outlives the groups:
            # each start in this process gets its own key space, or a second run would read the first one's keys
            store=dist.PrefixStore(f"megatron_ppo/start_{next(_STARTS)}", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            # NCCL binds its communicator to this GPU at once instead of guessing it at the first collective
            device_id=chosen if chosen.type == "cuda" else None,
        )
    initialize_model_parallel(layout)
    seed_everything(seed)
    return env


def initialize_model_parallel(layout: MegatronConfig) -> None:
    """(Re)build Megatron's process groups for `layout` on the running world, the expert groups (EP × expert TP ×
    PP, the rest expert data parallel) included."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        expert_tensor_parallel_size=layout.expert_tensor_parallel_size,
    )


def seed_everything(seed: int) -> None:
    """torch's global generator (same on every rank: identical CPU-initialised master weights) and Megatron's
    tracked RNG states."""
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        model_parallel_cuda_manual_seed(seed)
    else:
        seed_model_parallel_rng(
            seed,
            parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_expert_model_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_rank(),
        )


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
