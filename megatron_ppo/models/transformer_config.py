"""Megatron `TransformerConfig` from our model and layout configs, with the CPU path's settings."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_ppo.config.layout import padded_vocab_size  # noqa: F401  (re-exported: the models' vocabulary)
from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models.dtypes import DTYPES
from megatron_ppo.models.kernels import fusion_flags, uses_transformer_engine
from megatron_ppo.parallel.device import on_cuda


def moe_settings(model: ModelConfig, layout: MegatronConfig, with_aux_loss: bool) -> dict[str, Any]:
    """Megatron's MoE fields for `model.num_experts` > 0 (empty for a dense model), routed as Hugging Face's
    Qwen3-MoE routes: p = softmax(router logits) over all experts, the top `num_experts_per_tok` chosen; with
    `norm_topk_prob` their weights are renormalised, p_i / Σ_topk p_j, which equals Megatron's softmax over the
    top-k logits (`moe_router_pre_softmax=False`); without it they stay p_i (softmax before top-k). Dropless:
    no capacity factor, every token reaches its experts. `with_aux_loss`: the router's load-balancing loss
    (Switch: E · Σ_e f_e · P_e per layer and micro-batch, f_e the share of the k·T assignments, P_e the mean
    router probability; padding excluded) times `router_aux_loss_coef`, summed over layers, enters this role's
    backward through Megatron's `MoEAuxLossAutoScaler` — the actor only, as in Hugging Face's causal LM (its critic
    heads add none). The coefficient passes through as verl's mbridge passes it; Hugging Face's own loss is k × the
    mean over layers, so the same coefficient weighs Megatron's num_layers/k times as much.
    Experts: Transformer Engine's grouped GEMM with its layer spec (CUDA); Megatron's SequentialMLP otherwise."""
    if not model.num_experts:
        return {}
    coefficient = model.router_aux_loss_coef if with_aux_loss else 0.0
    return {
        "num_moe_experts": model.num_experts,
        "moe_router_topk": model.num_experts_per_tok,
        "moe_ffn_hidden_size": model.moe_intermediate_size,
        "moe_router_pre_softmax": not model.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_expert_capacity_factor": None,
        "moe_router_load_balancing_type": "aux_loss" if coefficient > 0 else "none",
        "moe_aux_loss_coeff": coefficient,
        "moe_token_dispatcher_type": model.moe_token_dispatcher,
        "moe_grouped_gemm": uses_transformer_engine(model),
        "expert_model_parallel_size": layout.expert_model_parallel_size,
        "expert_tensor_parallel_size": layout.expert_tensor_parallel_size,
    }


def build_transformer_config(
    model: ModelConfig, layout: MegatronConfig, with_aux_loss: bool = False, routing_replay: bool = False
) -> TransformerConfig:
    """The Megatron config for one role, for the device chosen at start (`megatron_ppo.parallel.device`).

    On CUDA: weights initialised directly on the GPU (each rank draws its own shard) unless
    `model.use_cpu_initialization` asks for layout-independent weights; each fusion on where its kernel imports
    (`models.kernels.fusion_flags`); batched pipeline messages without virtual stages. On CPU: weights initialised
    on the CPU (a full master weight is drawn, then split, so every TP layout starts from the same weights), no
    fused kernels, and pipeline messages sent one by one. Under virtual stages, on either device, Megatron-LM's own
    setting for the interleaved schedule: messages sent one by one and overlapped with compute
    (`overlap_p2p_comm`), each exchange one way. Without it the schedule's two-way exchanges, batched, pair the
    messages to the one neighbour at PP = 2 out of order (silently corrupting the gradients, and crossing the
    shapes of Megatron's shape exchange, NVIDIA/Megatron-LM#5100); and waited for in each call, a stage blocked
    sending a tensor while its out-of-step peer blocked in the shape exchange before it: TP 2 × PP 2 × VPP 2 with
    token budgets deadlocked on gloo. Pipeline
    messages of one fixed shape per pass (`variable_seq_lengths` off, set per pass by `models.schedule.model_shapes`).
    MoE fields: `moe_settings`; `routing_replay` gives each router Megatron's `RouterReplay`
    (`models.router_replay`)."""
    cuda = on_cuda()
    interleaved = (layout.virtual_pipeline_model_parallel_size or 1) > 1
    dtype = DTYPES[model.params_dtype]
    swiglu = model.activation == "swiglu"
    config = TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size or 4 * model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype is torch.bfloat16,
        fp16=dtype is torch.float16,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=layout.virtual_pipeline_model_parallel_size,
        context_parallel_size=layout.context_parallel_size,
        sequence_parallel=layout.sequence_parallel,
        recompute_granularity=layout.recompute_granularity,
        recompute_method=layout.recompute_method,
        recompute_num_layers=layout.recompute_num_layers,
        use_cpu_initialization=not cuda or model.use_cpu_initialization,
        overlap_p2p_comm=interleaved,
        batch_p2p_comm=cuda and not interleaved,
        **fusion_flags(model),
        **moe_settings(model, layout, with_aux_loss),
        moe_enable_routing_replay=routing_replay,
    )
    # variable_seq_lengths stays off: the schedule pads each pipeline pass to one shape and sets the flag for a
    # pass that keeps several (`models.schedule.model_shapes`)
    return config
