"""Process groups (torchrun/Slurm → torch.distributed → Megatron parallel_state) and the CPU compatibility layer."""

from megatron_ppo.parallel.distributed import (
    DistEnv,
    destroy_distributed,
    dist_env_from_environment,
    first_host,
    init_distributed,
    initialize_model_parallel,
    seed_everything,
)

__all__ = [
    "DistEnv",
    "destroy_distributed",
    "dist_env_from_environment",
    "first_host",
    "init_distributed",
    "initialize_model_parallel",
    "seed_everything",
]
