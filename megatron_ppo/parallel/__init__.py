"""Process groups (torchrun/Slurm → torch.distributed → Megatron parallel_state) and the CPU compatibility layer.

Where a process sits in its job (`launch_env`) imports nothing heavy; the process-group functions import torch and
megatron-core, so they load on first use: a command that starts no process group (validate, plan, report) does not
pay the ~5 s of megatron-core's import.
"""

from typing import Any

from megatron_ppo.parallel.launch_env import DistEnv, dist_env_from_environment, first_host

# the names of `parallel.distributed` this package gives, loaded when first asked for
_PROCESS_GROUPS = ("destroy_distributed", "init_distributed", "initialize_model_parallel", "seed_everything")

__all__ = ["DistEnv", "dist_env_from_environment", "first_host", *_PROCESS_GROUPS]


def __getattr__(name: str) -> Any:
    if name in _PROCESS_GROUPS:
        from megatron_ppo.parallel import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
