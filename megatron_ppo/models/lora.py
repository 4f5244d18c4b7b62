"""LoRA adapters on Megatron's own tensor-parallel linear layers (the local spec's `ColumnParallelLinear` and
`RowParallelLinear`): y = W x + (α / r) · B A dropout(x), the base W frozen, only A `[r, in]` and B `[out, r]` trained.

The layers are sharded as HF peft's Megatron LoRA (`peft.tuners.lora.tp_layer.LoraParallelLinear`) shards them, so
that no adapter needs a collective of its own beyond the ones Megatron's linear layers already do:
  column-parallel base (linear_qkv, linear_fc1; W split by output rows):  A whole on every TP rank, B a
      `ColumnParallelLinear` (its output rows split as W's are)
  row-parallel base (linear_proj, linear_fc2; W split by input columns):   A a `RowParallelLinear` (its input
      columns split as W's are; the partial products all-reduced, or reduce-scattered under sequence parallelism),
      B whole on every TP rank
With sequence parallelism a whole (TP-replicated) adapter matrix sees only this rank's share of the sequence, so its
gradient is partial: it is marked `sequence_parallel`, and Megatron's `finalize_model_grads` all-reduces it over TP as
it does the layer norms'.

Why not peft's `LoraParallelLinear` itself: it wraps the base layer, so the base's parameters move under
`base_layer.` (our conversion table and every non-LoRA checkpoint name them without it), and Megatron's sharded
checkpoint then saves the wrapper's tensors as replicated (it knows no `sharded_state_dict` for it: a TP-split base
weight would be written wrong); it marks nothing for the sequence-parallel gradient reduction, and it overwrites the
`params_dtype` of the Megatron config it is given. Here the adapters are subclasses of the base layers named in the
layer spec (`with_lora`): the base keeps its names and its checkpoint sharding, and the adapters add
`<layer>.lora_A.weight` and `<layer>.lora_B.weight`, each sharded in checkpoints as it is in memory. peft is the
reference the parity tests compare with and the format `convert mcore-to-hf` writes (`models.lora_export`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ppo.config.schema import LoraSettings

# The local spec's linear layers an adapter may sit on (verl's Megatron names), and where each is in the spec
TARGETS = {
    "linear_qkv": ("self_attention", "linear_qkv"),
    "linear_proj": ("self_attention", "linear_proj"),
    "linear_fc1": ("mlp", "linear_fc1"),
    "linear_fc2": ("mlp", "linear_fc2"),
}
ADAPTER_KEYS = (".lora_A.", ".lora_B.")  # what adapter parameter names contain (checkpoint keys too)


def is_adapter(name: str) -> bool:
    """Whether the parameter or checkpoint key `name` is an adapter's."""
    return any(key in name for key in ADAPTER_KEYS)


def _uniform_init(fan_in: int) -> partial:
    """peft's default for A (kaiming-uniform with a = √5): U(−1/√fan_in, 1/√fan_in), fan_in the whole layer's input
    width (not a TP shard's), so the draw's scale does not depend on the layout."""
    bound = 1.0 / math.sqrt(fan_in)
    return partial(torch.nn.init.uniform_, a=-bound, b=bound)


def _replicated(rows: int, columns: int, config: Any, sequence_parallel: bool) -> torch.nn.Parameter:
    """A TP-replicated adapter matrix, zero (filled by the caller); under sequence parallelism marked for the
    TP all-reduce of its gradient."""
    weight = torch.nn.Parameter(torch.zeros(rows, columns, dtype=config.params_dtype))
    if sequence_parallel:
        weight.sequence_parallel = True
    return weight


def _broadcast_over_tensor_parallel(tensor: torch.Tensor) -> None:
    """Make a TP-replicated tensor equal on every TP rank (the first rank's draw)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.broadcast(
            tensor.data,
            src=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )


class _Replicated(torch.nn.Module):
    """A bias-free linear map whose weight every TP rank holds whole: `weight` `[out, in]`."""

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)


class LoraColumnParallelLinear(ColumnParallelLinear):
    """Megatron's `ColumnParallelLinear` plus an adapter: A `[r, in]` whole on every TP rank (on this rank's
    sequence share under SP), B `[out / TP, r]` a `ColumnParallelLinear` split as the base's rows are (it all-gathers
    the rank-r activations under SP, as the base all-gathers its input). `gated`: the base is a gated MLP's
    linear_fc1 ([gate; up], a TP rank holding its rows of each half), whose checkpoint sharding B's follows."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoraSettings, gated: bool = False,
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(input_size, output_size, **kwargs)
        config = kwargs["config"]
        self.lora_gated = gated and config.gated_linear_unit
        self.lora_scaling = lora.alpha / lora.rank
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        self.lora_enabled = True
        self.lora_A = _Replicated(_replicated(lora.rank, input_size, config, config.sequence_parallel))
        _uniform_init(input_size)(self.lora_A.weight.data)
        _broadcast_over_tensor_parallel(self.lora_A.weight)
        self.lora_B = ColumnParallelLinear(
            lora.rank, output_size, config=config, init_method=torch.nn.init.zeros_, bias=False,
            gather_output=self.gather_output, skip_bias_add=True,
        )  # fmt: skip

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None, runtime_gather_output: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, bias = super().forward(input_, weight, runtime_gather_output)
        if self.lora_enabled:
            update, _ = self.lora_B(self.lora_A(self.lora_dropout(input_)), runtime_gather_output=runtime_gather_output)
            output = output + self.lora_scaling * update
        return output, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The base's entries (A among them, whole: replicated over TP), with B's as B shards them (rows; of a gated
        linear_fc1, each half's rows, as `MLP.sharded_state_dict` shards the base weight)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        b_state = self.lora_B.sharded_state_dict(f"{prefix}lora_B.", sharded_offsets, metadata)
        if self.lora_gated:
            key = f"{prefix}lora_B.weight"
            b_state[key] = _swiglu_sharded(b_state[key], sharded_offsets, metadata)
        state.update(b_state)
        return state


class LoraRowParallelLinear(RowParallelLinear):
    """Megatron's `RowParallelLinear` plus an adapter: A `[r, in / TP]` a `RowParallelLinear` split as the base's
    columns are (its partial products all-reduced, or reduce-scattered over the sequence under SP), B `[out, r]`
    whole on every TP rank."""

    def __init__(self, input_size: int, output_size: int, *, lora: LoraSettings, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        config = kwargs["config"]
        self.lora_scaling = lora.alpha / lora.rank
        self.lora_dropout = torch.nn.Dropout(lora.dropout) if lora.dropout else torch.nn.Identity()
        self.lora_enabled = True
        self.lora_A = RowParallelLinear(
            input_size, lora.rank, config=config, init_method=_uniform_init(input_size), bias=False,
            input_is_parallel=True, skip_bias_add=True,
        )  # fmt: skip
        self.lora_B = _Replicated(_replicated(output_size, lora.rank, config, config.sequence_parallel))

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        output, bias = super().forward(input_)
        if self.lora_enabled:
            low, _ = self.lora_A(self.lora_dropout(input_))
            output = output + self.lora_scaling * self.lora_B(low)
        return output, bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """The base's entries (B among them, whole: replicated over TP), with A's as A shards them (columns)."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(self.lora_A.sharded_state_dict(f"{prefix}lora_A.", sharded_offsets, metadata))
        return state


def _swiglu_sharded(sharded: Any, sharded_offsets: tuple, metadata: dict | None) -> Any:
    """Megatron's `apply_swiglu_sharded_factory` (its checkpoint sharding of a gated linear_fc1's rows) with the
    arguments this megatron-core takes (0.19 adds the process groups and `singleton_local_shards`)."""
    accepted = inspect.signature(apply_swiglu_sharded_factory).parameters
    options = {"singleton_local_shards": (metadata or {}).get("singleton_local_shards", False),
               "tp_group": parallel_state.get_tensor_model_parallel_group(),
               "dp_group": (metadata or {}).get("dp_cp_group")}  # fmt: skip
    return apply_swiglu_sharded_factory(sharded, sharded_offsets,
                                        **{k: v for k, v in options.items() if k in accepted})  # fmt: skip


LORA_LAYERS = (LoraColumnParallelLinear, LoraRowParallelLinear)
_LORA_CLASS = {ColumnParallelLinear: LoraColumnParallelLinear, RowParallelLinear: LoraRowParallelLinear}


def with_lora(spec: ModuleSpec, lora: LoraSettings) -> ModuleSpec:
    """The local GPT layer spec with each of `lora.target_modules` replaced by its adapter-carrying subclass
    (changed in place and returned, as `attention.with_sdpa_attention` does)."""
    for target in lora.target_modules:
        parent, name = TARGETS[target]
        submodules = _submodules(getattr(spec.submodules, parent))
        base = getattr(submodules, name)
        if base not in _LORA_CLASS:
            raise ValueError(f"{target}: LoRA sits on Megatron's local ColumnParallelLinear/RowParallelLinear, "
                             f"this layer spec has {base!r}")  # fmt: skip
        params = {"lora": lora, "gated": True} if target == "linear_fc1" else {"lora": lora}
        setattr(submodules, name, ModuleSpec(module=_LORA_CLASS[base], params=params))
    return spec


def _submodules(spec: Any) -> Any:
    """A layer spec entry's submodules: a `ModuleSpec`'s, or (megatron-core 0.19's MLP, a `functools.partial` of
    `MLP.as_mlp_submodule`) the partial's `submodules` argument."""
    return spec.keywords["submodules"] if isinstance(spec, partial) else spec.submodules


def lora_layers(chunks: Iterable[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LORA_LAYERS):
                yield module


def freeze_base(chunk: torch.nn.Module, trained: tuple[str, ...] = ()) -> None:
    """Only the adapters (and parameters whose names start with one of `trained`, the critic's value head) keep
    gradients; call before Megatron's DDP wraps the chunk, which gives gradient buffers to trained parameters only
    (and the optimizer then holds those alone)."""
    for name, param in chunk.named_parameters():
        param.requires_grad_(is_adapter(f".{name}") or name.startswith(trained))


@contextmanager
def adapters_disabled(chunks: Iterable[torch.nn.Module]) -> Iterator[None]:
    """While inside: the chunks compute their base model (every adapter skipped: the reference a LoRA actor holds);
    afterwards, also after an error, the adapters are back."""
    layers = list(lora_layers(chunks))
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


def describe_adapters(role: str, chunks: Iterable[torch.nn.Module], lora: LoraSettings) -> str:
    """One line for the run's log: the role's adapters (rank, alpha, targets) and the parameters this rank trains
    (adapters, and a critic's value head) against all it holds."""
    parameters = [p for chunk in chunks for p in chunk.parameters()]
    trained = sum(p.numel() for p in parameters if p.requires_grad)
    held = sum(p.numel() for p in parameters)
    return (
        f"LoRA on the {role}: rank {lora.rank}, alpha {lora.alpha:g} (scale {lora.alpha / lora.rank:g}), on "
        f"{', '.join(lora.target_modules)}; {trained:,} of this rank's {held:,} parameters trained "
        f"({trained / max(held, 1):.2%}), the base frozen"
    )
