"""megatron-ppo: offline RLHF with PPO on the Megatron-Core backend."""

from megatron_ppo import deferred_compile, lazy_modules

__version__ = "0.1.0"

deferred_compile.install()  # before any module of this package imports Megatron-Core
lazy_modules.install()
