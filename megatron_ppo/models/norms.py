"""The local layer spec's normalisation layers, sequence-parallel capable as Megatron's fused and TE norms are.

With sequence parallelism each tensor-parallel rank normalises its own `s / TP` tokens of `[s, b, h]`
(LayerNorm: y = (x − mean(x)) / √(var(x) + ε) · w + b; RMSNorm: y = x / √(mean(x²) + ε) · w), so each rank's
gradient of `w` (and `b`) covers only its tokens: the full gradient is their sum over the TP group. As
Megatron's `FusedLayerNorm` and `TENorm` do, the parameters carry `sequence_parallel = config.sequence_parallel`,
and Megatron's `finalize_model_grads` (`_allreduce_non_tensor_model_parallel_grads`) all-reduces the marked
gradients over TP before the optimizer step. Megatron's own `WrappedTorchNorm` refuses sequence parallelism; the
torch modules built here are the same (`weight`, `bias` keys unchanged), so local checkpoints load either way.
"""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class LocalNorm:
    """`config.normalization`'s torch module over the last dimension (`[..., hidden]` → same shape), built by
    Megatron's norm call signature, its parameters marked for the sequence-parallel gradient all-reduce."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: object) -> torch.nn.Module:
        unsupported = [
            name
            for name in ("layernorm_zero_centered_gamma", "persist_layer_norm", "memory_efficient_layer_norm")
            if getattr(config, name, False)
        ]
        if unsupported or config.normalization not in _NORMS:
            raise ValueError(
                f"the local layer spec's norm supports normalization in {sorted(_NORMS)} without "
                f"{', '.join(unsupported) or 'extra options'} (got normalization={config.normalization!r}); use "
                "the Transformer Engine spec for the others"
            )
        norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for parameter in norm.parameters():
            parameter.sequence_parallel = config.sequence_parallel
        return norm


def with_local_norms(spec: ModuleSpec) -> ModuleSpec:
    """Megatron's local GPT layer spec with `LocalNorm` for every norm it builds (input, pre-MLP, query/key)."""
    layer = spec.submodules
    layer.input_layernorm = LocalNorm
    if layer.pre_mlp_layernorm is not IdentityOp:
        layer.pre_mlp_layernorm = LocalNorm
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, LocalNorm)
    return spec
