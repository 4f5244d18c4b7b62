"""Parameter and FLOP counts of the GPT the recipe describes (Llama/Qwen-style, dense or mixture of experts): the
planner's step-time estimate and the trainer's measured MFU (`train/throughput.py`) count with the same functions."""

from __future__ import annotations

from megatron_ppo.config.schema import TRAINED_ROLES, ModelConfig, PPOConfig
from megatron_ppo.planner.phases import Phase


def parameter_count(model: ModelConfig) -> int:
    """Parameters of a Llama/Qwen2/Qwen3-style GPT (untied or tied embeddings, optional QKV bias, optional QK
    layernorm: one weight of `head_dim` each for queries and keys per layer)."""
    h, heads = model.hidden_size, model.num_attention_heads
    kv_heads = model.num_query_groups or heads
    head_dim = model.kv_channels or h // heads
    ffn = model.ffn_hidden_size or 4 * h
    attention = h * heads * head_dim + 2 * h * kv_heads * head_dim + heads * head_dim * h
    if model.add_qkv_bias:
        attention += (heads + 2 * kv_heads) * head_dim
    if model.qk_layernorm:
        attention += 2 * head_dim
    mlp = (3 if model.activation == "swiglu" else 2) * h * ffn
    if model.num_experts:
        mlp = h * model.num_experts + expert_parameter_count(model) // model.num_layers  # router + experts
    layer = attention + mlp + 2 * h
    embeddings = model.vocab_size * h * (2 if model.untie_embeddings_and_output_weights else 1)
    return model.num_layers * layer + embeddings + h


def expert_parameter_count(model: ModelConfig) -> int:
    """Parameters of the routed experts, L · E · 3·h·f_moe (SwiGLU; 2·h·f_moe otherwise); 0 for a dense model."""
    per_expert = (3 if model.activation == "swiglu" else 2) * model.hidden_size * model.moe_intermediate_size
    return model.num_layers * model.num_experts * per_expert


def active_parameter_count(model: ModelConfig) -> int:
    """Parameters one token passes through: all but the experts it is not routed to, N − (1 − k/E)·N_experts
    (Qwen3-30B-A3B: 3.3 B of 30.5 B). Equal to `parameter_count` for a dense model."""
    experts = expert_parameter_count(model)
    if not experts:
        return parameter_count(model)
    return parameter_count(model) - experts + experts * model.num_experts_per_tok // model.num_experts


def flop_parameter_count(model: ModelConfig, role: str) -> int:
    """Parameters that enter a matrix product for every token: the transformer layers (of a mixture of experts,
    the active ones) and the vocabulary output layer (actor, reference); the critic's value head is ~h. The input
    embedding is a lookup and is left out."""
    embedding = model.vocab_size * model.hidden_size
    trunk = active_parameter_count(model) - embedding * (2 if model.untie_embeddings_and_output_weights else 1)
    return trunk + (embedding if role != "critic" else model.hidden_size + 1)


def pass_flops(model: ModelConfig, params: int, tokens: float, tokens_times_seq: float, *, train: bool,
               full_recompute: bool = False) -> float:  # fmt: skip
    """FLOPs of one pass of a model with `params` parameters over `tokens` tokens, where `tokens_times_seq` is
    Σ over rows of (row length)² (B·S² for B rows of S tokens). Forward:

        2·N·tokens  +  2·L·(heads·head_dim)·Σ s²

    the matrix products (2 FLOPs per parameter and token) and the core attention, q·kᵀ and p·v at 2·(heads·head_dim)
    FLOPs each per query–key pair over the causal half of the pairs, s²/2 per row of s tokens — as Megatron-LM
    counts it (`num_floating_point_operations`: `query_projection_size · seq_length / 2 · 2` per token and layer).
    A training pass adds the backward (2× the forward), and full recompute one more forward."""
    query_width = model.num_attention_heads * (model.kv_channels or model.hidden_size // model.num_attention_heads)
    forward = 2 * params * tokens + 2 * model.num_layers * query_width * tokens_times_seq
    if not train:
        return forward
    return forward * (4 if full_recompute else 3)


def iteration_flops(
    config: PPOConfig, params: dict[str, int], tokens: float, tokens_times_seq: float
) -> dict[Phase, float]:
    """FLOPs of one PPO iteration by phase, for the roles in `params` (role → parameter count):
    experience = a forward of each role (the reference has the actor's shape), a role's update = `ppo_epochs`
    training passes of the actor / critic. The planner and the measured MFU (`train/throughput.py`) both use it."""
    m = config.model
    flops = {Phase.EXPERIENCE: sum(pass_flops(m, n, tokens, tokens_times_seq, train=False) for n in params.values())}
    for role in TRAINED_ROLES:
        if role in params:
            role_config = getattr(config, role)
            full = role_config.megatron.recompute_granularity == "full"
            flops[Phase.update(role)] = role_config.ppo_epochs * pass_flops(
                m, params[role], tokens, tokens_times_seq, train=True, full_recompute=full
            )
    return flops
