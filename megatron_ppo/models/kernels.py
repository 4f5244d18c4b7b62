"""Which kernels this process can run, decided by what imports rather than by "Transformer Engine is installed".

Each Megatron fusion flag is turned on only on CUDA and only where its kernel imports (Megatron's own probes):

    bias_activation_fusion        torch-scripted bias+SwiGLU/GeLU in megatron.core.fusions (ships with Megatron)
    bias_dropout_fusion           torch-scripted bias+dropout+add (ships with Megatron)
    masked_softmax_fusion         the `scaled_masked_softmax_cuda` extensions (apex / Megatron-LM kernels)
    apply_rope_fusion             Transformer Engine's fused RoPE (megatron.core rope_utils finds it)
    gradient_accumulation_fusion  the `fused_weight_gradient_mlp_cuda` extension (apex)
    persist_layer_norm            apex's persistent layer norm (megatron.core.fusions.fused_layer_norm finds it)

The optimizer follows Megatron's own choice: Transformer Engine's or apex's FusedAdam when importable, torch's
(multi-tensor) AdamW otherwise.
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_ppo.config.schema import ModelConfig, PPOConfig
from megatron_ppo.parallel.device import on_cuda

FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
)


def transformer_engine_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_usable() -> bool:
    return on_cuda() and transformer_engine_importable()


def importable_fusions() -> dict[str, bool]:
    """Whether each fusion's kernel imports in this process (independent of the device)."""
    from megatron.core.fusions import fused_layer_norm
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    return {
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
        "masked_softmax_fusion": all(
            importlib.util.find_spec(name) is not None
            for name in ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda")
        ),
        "apply_rope_fusion": rope_utils.fused_apply_rotary_pos_emb is not None,
        "gradient_accumulation_fusion": layers._grad_accum_fusion_available,
        "persist_layer_norm": fused_layer_norm.HAVE_PERSIST_LAYER_NORM,
    }


def fusion_flags(model: ModelConfig) -> dict[str, bool]:
    """The fusion flags for `TransformerConfig`: all off on CPU; on CUDA each on where its kernel imports and the
    model can use it (Megatron fuses a bias with GeLU only when there is a bias; RoPE fusion needs RoPE; the
    persistent layer norm needs the local spec's LayerNorm)."""
    if not on_cuda():
        return dict.fromkeys(FUSIONS, False)
    flags = importable_fusions()
    swiglu = model.activation == "swiglu"
    flags["bias_activation_fusion"] &= swiglu or model.add_bias_linear
    flags["apply_rope_fusion"] &= model.position_embedding_type == "rope"
    # only apex's LayerNorm of the local spec has a persistent kernel (torch's norms refuse the flag; TE ignores it)
    flags["persist_layer_norm"] &= model.normalization == "LayerNorm" and not uses_transformer_engine(model)
    return flags


def optimizer_implementation() -> str:
    """The Adam class Megatron's `get_megatron_optimizer` instantiates here."""
    from megatron.core import optimizer

    if optimizer.USING_PYTORCH_OPTIMIZER:
        return "torch AdamW (multi-tensor)" if on_cuda() else "torch AdamW"
    return f"FusedAdam ({optimizer.Adam.__module__.split('.')[0]})"


def uses_transformer_engine(model: ModelConfig) -> bool:
    """Transformer Engine's layer spec: on CUDA when it imports (`auto`), or when demanded."""
    return model.transformer_impl != "local" and transformer_engine_usable()


def describe_kernels(config: PPOConfig) -> str:
    """One line for the start of a run: layer spec, attention kernel, fusions on, optimizer, dtype."""
    te = uses_transformer_engine(config.model)
    if te:
        spec, attention = "Transformer Engine", "TEDotProductAttention (flash/fused)"
    else:
        backend = "flash / memory-efficient" if on_cuda() else "math (CPU)"
        spec, attention = "Megatron local", f"torch scaled_dot_product_attention ({backend})"
    fused = [name.removesuffix("_fusion") for name, on in fusion_flags(config.model).items() if on]
    device = f"cuda ({torch.cuda.get_device_name()})" if on_cuda() else "cpu"
    return (
        f"kernels: device {device}; spec {spec}; attention {attention}; fusions {', '.join(fused) or 'none'}; "
        f"optimizer {optimizer_implementation()}; dtype {config.model.params_dtype}"
    )
