"""What a pass that raised leaves on Megatron's layers, released before the pass runs again.

A forward that raises half-way (an out-of-memory error in `linear_fc1`, say) unwinds its Python frames, but some
of Megatron's layers keep per-pass state on themselves between two points of one forward: megatron-core 0.19's
`TransformerLayer.mlp_norm_manager` holds the input of the pre-MLP norm — an activation with its autograd graph —
from `_forward_pre_mlp_layernorm` until the end of `_forward_mlp`; the norms' activation recompute keeps a
`CheckpointWithoutOutput` (its autograd context and outputs) on the layer (`input_layernorm_checkpoint`,
`pre_mlp_norm_checkpoint`, 0.16.1 and 0.19); MoE token dispatchers keep the routing of the pass on themselves. When
the forward raises between the two points, the state stays. Through the graph's gradient-accumulator hooks
(Megatron's DDP registers one per parameter, a closure on the DDP wrapper) it is part of a reference cycle through
C++ autograd nodes, so the failed pass's activations live until the layer's next forward overwrites them — exactly
while the out-of-memory back-off retries, the one moment memory is short.

A module's lasting state never holds an autograd graph (parameters are leaves, buffers carry none), so what holds
one after a failed pass is that pass's: `release_failed_pass` sets every such attribute of every module — and of
the plain objects the modules hold (a dispatcher, a norm's offload manager), one level down — to None. The next
forward sets them again as it always does.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ppo.models.gpt import RoleModel, unwrap


def holds_graph(value: Any) -> bool:
    """Whether `value` is (or is a list/tuple holding) a tensor with an autograd history or an autograd node."""
    if isinstance(value, torch.Tensor):
        return value.grad_fn is not None
    if isinstance(value, torch.autograd.graph.Node):
        return True
    if isinstance(value, list | tuple):
        return any(holds_graph(item) for item in value)
    return False


def _plain_object(value: Any) -> bool:
    """An instance of a Python class that is neither a module, a tensor nor a type: a holder of per-pass state."""
    return (
        hasattr(value, "__dict__")
        and not isinstance(value, torch.nn.Module | torch.Tensor | type)
        and not callable(getattr(value, "__func__", None))
    )


def release_failed_pass(model: RoleModel) -> list[str]:
    """Set to None every attribute of `model`'s modules (and of the plain objects they hold) that holds an autograd
    graph; returns their dotted names (module path, attribute). Only after a pass that raised: during a pass that
    is still running these are what its backward needs."""
    released = []
    for index, chunk in enumerate(model.chunks):
        for path, module in unwrap(chunk).named_modules():
            for name, value in list(vars(module).items()):
                if name.startswith("_"):  # torch.nn.Module's own tables (parameters, buffers, hooks)
                    continue
                if holds_graph(value):
                    setattr(module, name, None)
                    released.append(f"chunk{index}.{path}.{name}")
                elif _plain_object(value):
                    for inner, held in list(vars(value).items()):
                        if holds_graph(held):
                            setattr(value, inner, None)
                            released.append(f"chunk{index}.{path}.{name}.{inner}")
    return released
