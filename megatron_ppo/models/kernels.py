"""Which kernels this process can run, decided by what imports rather than by "Transformer Engine is installed".

Each Megatron fusion flag is turned on only on CUDA and only where its kernel imports (Megatron's own probes):

    bias_activation_fusion        bias+SwiGLU/GeLU in megatron.core.fusions (ships with Megatron)
    bias_dropout_fusion           bias+dropout+add in megatron.core.fusions (ships with Megatron)
    masked_softmax_fusion         the `scaled_masked_softmax_cuda` extensions (apex / Megatron-LM kernels)
    apply_rope_fusion             Transformer Engine's fused RoPE (megatron.core rope_utils finds it)
    gradient_accumulation_fusion  the `fused_weight_gradient_mlp_cuda` extension (apex)

`persist_layer_norm` (apex's persistent LayerNorm kernel) stays off whatever imports: the local spec's norms are
`models.norms.LocalNorm` (torch's, sequence-parallel capable), which has no such kernel and refuses the flag, and
Transformer Engine's norms ignore it.

The first two are not TorchScript: their functions are decorated with `megatron.core.jit.jit_fuser`, which is
`torch.compile` on torch ≥ 2.2 (megatron-core 0.16 and 0.19 alike). Each is compiled by Inductor (Triton kernels)
at its first call, in every process; a second input shape recompiles it once with that dimension dynamic
(torch's automatic dynamic shapes), and later widths reuse that graph.

The attention kernel of the local spec is the backend PyTorch's SDPA dispatcher picks for the run's shape, dtype
and mask (`sdpa_backend`: its own `_fused_sdp_choice`, which honours `torch.backends.cuda.*_sdp_enabled` and
`sdpa_kernel`); on a recent GPU that may be cuDNN rather than flash, on CPU it is PyTorch's CPU flash kernel.
Under the Transformer Engine spec, TE chooses among its flash, cuDNN-fused and unfused backends at the first
forward (`NVTE_FLASH_ATTN` / `NVTE_FUSED_ATTN` steer it).

The optimizer follows Megatron's own choice: Transformer Engine's or apex's FusedAdam when importable, torch's
(multi-tensor) AdamW otherwise.
"""

from __future__ import annotations

import importlib.util

import torch

from megatron_ppo.config.schema import LoraSettings, ModelConfig, PPOConfig
from megatron_ppo.parallel.device import on_cuda

FUSIONS = (
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
)


def transformer_engine_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def transformer_engine_usable() -> bool:
    return on_cuda() and transformer_engine_importable()


def importable_fusions() -> dict[str, bool]:
    """Whether each fusion's kernel imports in this process (independent of the device)."""
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
    }


def fusion_flags(model: ModelConfig, importable: dict[str, bool] | None = None) -> dict[str, bool]:
    """The fusion flags for `TransformerConfig`: all off on CPU; on CUDA each on where its kernel imports
    (`importable`, by default `importable_fusions()`: a test passes a machine's with apex and TE) and the model can
    use it (Megatron fuses a bias with GeLU only when there is a bias; RoPE fusion needs RoPE)."""
    if not on_cuda():
        return dict.fromkeys(FUSIONS, False)
    flags = dict(importable if importable is not None else importable_fusions())
    swiglu = model.activation == "swiglu"
    flags["bias_activation_fusion"] &= swiglu or model.add_bias_linear
    flags["apply_rope_fusion"] &= model.position_embedding_type == "rope"
    return flags


def optimizer_implementation() -> str:
    """The Adam class Megatron's `get_megatron_optimizer` instantiates here."""
    from megatron.core import optimizer

    if optimizer.USING_PYTORCH_OPTIMIZER:
        return "torch AdamW (multi-tensor)" if on_cuda() else "torch AdamW"
    return f"FusedAdam ({optimizer.Adam.__module__.split('.')[0]})"


def uses_transformer_engine(model: ModelConfig, lora: LoraSettings | None = None) -> bool:
    """Whether a role is built with Transformer Engine's layer spec: when demanded, or under `auto` on CUDA where TE
    imports — but not for a role with LoRA adapters (`lora` enabled), which sit on Megatron's local linear layers."""
    if model.transformer_impl == "local" or not transformer_engine_usable():
        return False
    return model.transformer_impl == "transformer_engine" or not (lora is not None and lora.enabled)


def role_specs(config: PPOConfig) -> dict[str, bool]:
    """Which roles the run builds with Transformer Engine's spec (`uses_transformer_engine`): the actor, the reference
    (a LoRA actor's is its own base model, adapters off: the actor's spec) and the critic, where the run builds
    them."""
    actor = uses_transformer_engine(config.model, config.actor.lora)
    specs = {"actor": actor}
    if config.needs_reference:
        specs["reference"] = actor if config.actor.lora.enabled else uses_transformer_engine(config.model)
    if config.needs_critic:
        specs["critic"] = uses_transformer_engine(config.model, config.critic.lora)
    return specs


def _spec_names(specs: dict[str, bool]) -> str:
    """The spec every role runs ("Transformer Engine" or "Megatron local"), else each role's."""
    name = {True: "Transformer Engine", False: "Megatron local"}
    if len(set(specs.values())) == 1:
        return name[next(iter(specs.values()))]
    return ", ".join(f"{role} {name[te]}" for role, te in specs.items()) + " (LoRA builds Megatron's local spec)"


SDPA_BACKENDS = {"FLASH_ATTENTION": "flash", "EFFICIENT_ATTENTION": "memory-efficient", "CUDNN_ATTENTION": "cuDNN",
                 "MATH": "math", "OVERRIDEABLE": "overrideable (a device's own)"}  # fmt: skip


def sdpa_backend(config: PPOConfig, masked: bool = False) -> str:
    """The backend `torch.nn.functional.scaled_dot_product_attention` runs for the actor's training attention on
    this device, asked of PyTorch's dispatcher itself with the tensors `SDPAttention` passes it (per
    tensor-parallel rank): query heads and key/value groups `[b, heads, S, hn]` as permuted views of `[S, b, heads,
    hn]`, b the actor's micro-batch rows, S the longest row padded as the schedule pads it (the width bucket and
    the layout's multiple, `models.widths`), the parameters' dtype, requiring gradients (the dispatcher refuses
    some kernels a backward); causal without a mask, or with a boolean mask (`[S, S]`, S at most 4096 here) and
    keys repeated per query head when `masked`."""
    from torch.nn.attention import SDPBackend

    from megatron_ppo.models.dtypes import DTYPES
    from megatron_ppo.models.widths import padded_width, width_bucket
    from megatron_ppo.parallel.device import current_device

    model, layout = config.model, config.actor.megatron
    tp = layout.tensor_model_parallel_size
    heads, groups = model.num_attention_heads // tp, (model.num_query_groups or model.num_attention_heads) // tp
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    longest = min(config.data.max_length, model.max_position_embeddings)
    bucket = width_bucket(layout.make_sequence_length_divisible_by, on_cuda())
    seq = padded_width(longest, layout.context_parallel_size, tp if layout.sequence_parallel else 1, bucket)
    seq = seq // layout.context_parallel_size  # this CP rank's tokens
    seq = min(seq, 4096) if masked else seq
    rows = config.actor.ppo_micro_batch_size_per_gpu or 1
    options = {"dtype": DTYPES[model.params_dtype], "device": current_device()}

    def projected(count: int) -> torch.Tensor:  # [S, b, heads, hn] → [b, heads, S, hn], as SDPAttention permutes
        return torch.zeros(seq, rows, count, head_dim, **options, requires_grad=True).permute(1, 2, 0, 3)

    query, key = projected(heads), projected(heads if masked else groups)
    mask = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=options["device"]).tril() if masked else None
    choice = torch._fused_sdp_choice(query, key, key, mask, 0.0, not masked, enable_gqa=groups != heads and not masked)
    name = SDPBackend(choice).name
    return SDPA_BACKENDS.get(name, name)


def transformer_engine_attention() -> str:
    """The attention backends Transformer Engine may pick among at its first forward, as its environment switches
    leave them enabled (`NVTE_FLASH_ATTN`, `NVTE_FUSED_ATTN`, `NVTE_UNFUSED_ATTN`, each on unless "0"); TE logs its
    choice with `NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1`."""
    import os

    switches = {"NVTE_FLASH_ATTN": "flash", "NVTE_FUSED_ATTN": "cuDNN fused", "NVTE_UNFUSED_ATTN": "unfused"}
    enabled = [name for key, name in switches.items() if os.environ.get(key, "1") != "0"]
    return f"TEDotProductAttention (TE picks among {' / '.join(enabled) or 'none enabled'})"


def describe_kernels(config: PPOConfig) -> str:
    """One line for the start of a run: layer spec (each role's where they differ: a LoRA actor is local beside a TE
    critic), the actor's attention kernel (the backend SDPA really picks), fusions on
    (those compiled with torch.compile marked), optimizer, dtype, and how sequences enter the model (packed THD
    with `model.pack_sequences`, else padded rows)."""
    specs = role_specs(config)
    spec, te = _spec_names(specs), specs["actor"]  # the attention and layout named: the actor's
    if te:
        attention = transformer_engine_attention()
    else:
        where = "" if on_cuda() else ", CPU kernel"
        attention = (f"torch scaled_dot_product_attention ({sdpa_backend(config)}{where}; with a mask "
                     f"{sdpa_backend(config, masked=True)})")  # fmt: skip
    compiled = ("bias_activation_fusion", "bias_dropout_fusion")  # megatron.core.jit.jit_fuser: torch.compile
    fused = [
        name.removesuffix("_fusion") + (" (torch.compile)" if name in compiled else "")
        for name, on in fusion_flags(config.model).items()
        if on
    ]
    device = f"cuda ({torch.cuda.get_device_name()})" if on_cuda() else "cpu"
    return (
        f"kernels: device {device}; spec {spec}; attention {attention}; fusions {', '.join(fused) or 'none'}; "
        f"optimizer {optimizer_implementation()}; dtype {config.model.params_dtype}; {_sequence_layout(config, te)}"
    )


def packed_attention(config: PPOConfig) -> str:
    """How the local spec's attention runs a pack on this device (`models.attention.packed_attention_path`, the
    choice `SDPAttention` makes at each call): one torch `varlen_attn` call per layer, or one SDPA call per
    sequence; for the actor's heads and dtype, without dropout (the layers are built with none)."""
    from megatron_ppo.models.attention import PACKED_PATHS, packed_attention_path
    from megatron_ppo.models.dtypes import DTYPES
    from megatron_ppo.parallel.device import current_device

    model = config.model
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    grouped = (model.num_query_groups or model.num_attention_heads) != model.num_attention_heads
    path = packed_attention_path(current_device(), DTYPES[model.params_dtype], head_dim, head_dim**-0.5, grouped, 0.0)
    return PACKED_PATHS[path]


def _sequence_layout(config: PPOConfig, te: bool) -> str:
    if not config.model.pack_sequences:
        return "sequences as padded rows"
    return f"sequences packed (THD, {'TE THD attention' if te else packed_attention(config)})"
