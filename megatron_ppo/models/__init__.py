"""Megatron-Core GPT models for the three roles, vocabulary-parallel log-probs, the pipeline schedule entry and
autoregressive generation."""

from megatron_ppo.models.gpt import RoleModel, build_role_model, copy_weights, eval_mode, select_layer_spec, unwrap
from megatron_ppo.models.logprobs import vocab_parallel_log_probs
from megatron_ppo.models.schedule import causal_attention_mask, run_micro_batches
from megatron_ppo.models.transformer_config import build_transformer_config, padded_vocab_size
from megatron_ppo.models.value_head import ValueHead

__all__ = [
    "RoleModel",
    "ValueHead",
    "build_role_model",
    "build_transformer_config",
    "causal_attention_mask",
    "copy_weights",
    "eval_mode",
    "padded_vocab_size",
    "run_micro_batches",
    "select_layer_spec",
    "unwrap",
    "vocab_parallel_log_probs",
]
