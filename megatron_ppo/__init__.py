"""megatron-ppo: offline RLHF with PPO on the Megatron-Core backend."""

__version__ = "0.1.0"
