"""Typed, composable, validated configuration (see `compose.py` for the rules)."""

from megatron_ppo.config.compose import VERL_ALIASES, build_config, compose_file, load_config, parse_override
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.layout import data_parallel_size, world_size
from megatron_ppo.config.schema import PPOConfig

__all__ = [
    "VERL_ALIASES",
    "ConfigError",
    "PPOConfig",
    "build_config",
    "compose_file",
    "data_parallel_size",
    "load_config",
    "parse_override",
    "world_size",
]
