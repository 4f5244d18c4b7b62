"""Core attention through `torch.nn.functional.scaled_dot_product_attention`, for Megatron's local layer spec.

Megatron's local `DotProductAttention` materialises the scores `[b, heads, s, s]` and casts them to fp32 for the
softmax: at 4096 tokens that alone is 1 GiB per micro-batch row and layer. SDPA computes

    out = softmax(q·kᵀ · scale + mask) · v

with the backend PyTorch's dispatcher picks for the shape, dtype and mask — flash, cuDNN or memory-efficient on a
GPU (no `s × s` tensor), its flash kernel on CPU (`models.kernels.sdpa_backend` names the one that runs). Grouped-
query attention is passed as is to the (causal, unmasked) flash kernel (`enable_gqa`: key/value heads are shared
by consecutive query heads, as in Megatron's `repeat_interleave`); with an explicit mask, keys and values are
repeated per query head for the memory-efficient kernel.

Packed sequences (`packed_seq_params`, THD, `models.packing`): causal attention inside each sequence of the pack,
by one of two paths, chosen in one place (`packed_attention_path`): on CUDA with a torch that has
`torch.nn.attention.varlen.varlen_attn` (2.10 and later), one variable-length flash call per layer over the whole
pack (`VARLEN`: its device cu_seqlens and host max length, grouped heads native, forward and backward, no host
read); elsewhere (the CPU, older torch, dropout) one SDPA call per sequence (`PER_SEQUENCE`). The first packed call
of each path in a process is logged.

Masks follow Megatron: a boolean `attention_mask` broadcastable to `[b, 1, sq, sk]`, True where attention is NOT
allowed. Without a mask, `AttnMaskType.causal` means the causal mask (passed to the kernel as `is_causal`, which
keeps the flash path). A query row with no allowed key (a padding row) gives a zero output here, where Megatron
gives the mean of all values; such rows carry no loss.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide

logger = logging.getLogger(__name__)

VARLEN = "varlen"  # one torch varlen_attn (flash) call per layer over the whole pack
PER_SEQUENCE = "per-sequence"  # one SDPA call per sequence of the pack
PACKED_PATHS = {VARLEN: "one torch varlen_attn (flash) call per layer", PER_SEQUENCE: "one SDPA call per sequence"}
PACKED_PATHS_RUN: set[str] = set()  # the packed paths this process has run (each logged at its first call)


@functools.cache
def torch_varlen_attn() -> Callable[..., torch.Tensor] | None:
    """torch's `varlen_attn` (2.10 and later), None in an older torch. Imported when a pack on a CUDA device first
    asks for it, not with this module: `torch.nn.attention.varlen` imports torch's compiler (dynamo), ~0.5
    CPU-seconds of every process, which a CPU or padded run never calls."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def varlen_causal_keywords(function: Callable[..., Any], scale: float, head_dim: int, grouped: bool) -> dict | None:
    """The keyword arguments of a causal call of torch's `varlen_attn` (`function`) at softmax `scale`, by its
    signature in the torch release installed; None where that release cannot make the call:

        2.10          varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, return_aux=None): causal by
                      `is_causal`; no scale argument (the kernel's 1/√d only); grouped heads native to the kernel
        2.11          (…, *, return_aux, scale, window_size=(-1, -1)): causal by window_size=(-1, 0)
        2.12 – 2.13   (…, *, return_aux, scale, window_size, enable_gqa=False, …): and grouped heads by enable_gqa
                      (refused without it)"""
    parameters = inspect.signature(function).parameters
    if "window_size" in parameters and "scale" in parameters:
        keywords: dict[str, Any] = {"window_size": (-1, 0), "scale": scale}
        if "enable_gqa" in parameters:
            keywords["enable_gqa"] = grouped
        return keywords
    if "is_causal" in parameters:
        return {"is_causal": True} if scale == head_dim**-0.5 else None
    return None


def packed_attention_path(device: torch.device, dtype: torch.dtype, head_dim: int, scale: float, grouped: bool,
                          dropout: float, capability: tuple[int, int] | None = None,
                          function: Callable[..., Any] | None = None) -> str:  # fmt: skip
    """The one place a pack's attention path is chosen: `VARLEN` where torch's variable-length flash kernel runs
    the call — a CUDA device of compute capability 8.0 or later (`capability`, asked of the device when None),
    torch's `varlen_attn` (`function`, `torch_varlen_attn()` when None) callable causally at this `scale` in this
    release (`varlen_causal_keywords`), fp16 or bf16, a head dimension the flash kernel takes (a multiple of 8, at
    most 256), no dropout (varlen_attn has none) and flash attention enabled (`torch.backends.cuda.flash_sdp_enabled`);
    `PER_SEQUENCE` otherwise."""
    if device.type != "cuda" or dropout > 0 or dtype not in (torch.float16, torch.bfloat16):
        return PER_SEQUENCE
    if head_dim % 8 or head_dim > 256 or not torch.backends.cuda.flash_sdp_enabled():
        return PER_SEQUENCE
    if (capability or torch.cuda.get_device_capability(device)) < (8, 0):
        return PER_SEQUENCE
    function = function or torch_varlen_attn()
    if function is None:
        return PER_SEQUENCE
    return VARLEN if varlen_causal_keywords(function, scale, head_dim, grouped) is not None else PER_SEQUENCE


class SDPAttention(MegatronModule):
    """Drop-in `core_attention`: `(query [sq, b, np, hn], key/value [sk, b, ng, hn], mask) -> [sq, b, np·hn]`,
    `np`/`ng` the query heads / query groups of this tensor-parallel rank."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        unsupported = {
            "context_parallel_size > 1": config.context_parallel_size > 1,
            "apply_query_key_layer_scaling": config.apply_query_key_layer_scaling,
            f"softmax_type={config.softmax_type!r}": config.softmax_type != "vanilla",
            "window_size": config.window_size is not None,
        }
        named = [name for name, present in unsupported.items() if present]
        if named:
            raise ValueError(
                f"SDPA core attention does not support {', '.join(named)}; use the Transformer Engine spec "
                "(model.transformer_impl=transformer_engine on CUDA)"
            )
        self.attn_mask_type = attn_mask_type
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if pg_collection is None:
            world = parallel_state.get_tensor_model_parallel_world_size()
        else:
            world = pg_collection.tp.size()
        self.heads_per_partition = divide(config.num_attention_heads, world)
        self.groups_per_partition = divide(config.num_query_groups, world)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPA core attention takes no attention_bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        sq, b = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        causal = attention_mask is None and mask_type == AttnMaskType.causal and sq > 1
        allowed = None if attention_mask is None else ~attention_mask
        grouped = self.heads_per_partition != self.groups_per_partition
        if grouped and allowed is not None:
            # flash takes no mask and the memory-efficient kernel no grouped heads: repeat keys and values so a
            # masked call still avoids the math kernel's [s, s] scores on a GPU
            repeats = self.heads_per_partition // self.groups_per_partition
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
            grouped = False
        dropout = self.dropout if self.training else 0.0
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, is_causal=causal, scale=self.softmax_scale,
                enable_gqa=grouped,
            )  # fmt: skip
        if allowed is not None:  # rows with no allowed key: a zero output (the math kernel may give NaN)
            out = out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads_per_partition * out.shape[-1])

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any) -> torch.Tensor:
        """Packed sequences (THD, `models.packing`): `query [t, np, hn]`, `key/value [t, ng, hn]`; causal attention
        inside each segment [cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1]) of the pack, by the path
        `packed_attention_path` chooses: `_varlen` or `_per_sequence`. Returns `[t, np·hn]`."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPA core attention takes packed sequences in the thd format, not {params.qkv_format}")
        dropout = self.dropout if self.training else 0.0
        grouped = self.heads_per_partition != self.groups_per_partition
        path = packed_attention_path(query.device, query.dtype, query.shape[-1], self.softmax_scale, grouped, dropout)
        if path not in PACKED_PATHS_RUN:
            PACKED_PATHS_RUN.add(path)
            logger.info("packed attention: %s (%s, %s)", PACKED_PATHS[path], query.device.type, query.dtype)
        if path == VARLEN:
            return self._varlen(query, key, value, params, grouped)
        return self._per_sequence(query, key, value, params, dropout, grouped)

    def _varlen(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, grouped: bool,
                function: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """The whole pack in one causal call of torch's `varlen_attn` (`function`, by default torch's): the padded
        cu_seqlens (int32, on the pack's device: the segments, each causal, as the per-sequence path cuts them) and
        the host `max_seqlen_*` (the longest segment), key/value groups as they are (the kernel shares each across
        its query heads). No host read, one kernel forward and one backward per layer."""
        function = function or torch_varlen_attn()
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_kv = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        keywords = varlen_causal_keywords(function, self.softmax_scale, query.shape[-1], grouped)
        out = function(query, key, value, cu_q, cu_kv, params.max_seqlen_q, params.max_seqlen_kv, **keywords)
        return out.reshape(query.shape[0], -1)

    def _per_sequence(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, dropout: float,
                      grouped: bool) -> torch.Tensor:  # fmt: skip
        """One SDPA call per segment (its flash path, `is_causal`): on CPU 3–4× faster, forward and backward, than one
        call with a
        block-diagonal causal mask over the whole pack (16 sequences of 8–512 tokens, bench/bench_packing.py
        measures both), which computes all t² scores. Returns `[t, np·hn]`.

        The segments are `torch.split` views of the token dimension (each `[p_i, heads, hn]` contiguous, seen as
        `[1, heads, p_i, hn]` by SDPA, as the padded path's permuted rows are): the backward concatenates their
        gradients once per tensor, where slicing each segment out would cost a zeroed full-pack gradient per
        segment and a sum of them (O(segments · t) per layer). The bounds come from the host
        (`HostPackedSeqParams.segment_bounds`) when the pack has them, else from cu_seqlens (a device read)."""
        bounds = getattr(params, "segment_bounds", ())
        if not bounds:
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            bounds = cu.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"the pack's segments cover {bounds[-1]} tokens, the query holds {query.shape[0]}")
        sizes = [end - start for start, end in itertools.pairwise(bounds)]
        out = []
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout > 0 else contextlib.nullcontext():
            for q, k, v in zip(*(t.split(sizes) for t in (query, key, value)), strict=True):
                if q.shape[0]:
                    out.append(F.scaled_dot_product_attention(
                        *(t.permute(1, 0, 2)[None] for t in (q, k, v)), dropout_p=dropout, is_causal=q.shape[0] > 1,
                        scale=self.softmax_scale, enable_gqa=grouped,
                    ).squeeze(0).permute(1, 0, 2))  # a view: `[0]` would copy its gradient into zeros  # fmt: skip
        return torch.cat(out).reshape(query.shape[0], -1)


def with_sdpa_attention(spec: ModuleSpec) -> ModuleSpec:
    """Megatron's local GPT layer spec with `SDPAttention` as the self-attention's `core_attention`."""
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
