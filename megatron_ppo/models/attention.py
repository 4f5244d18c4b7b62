"""Core attention through `torch.nn.functional.scaled_dot_product_attention`, for Megatron's local layer spec.

Megatron's local `DotProductAttention` materialises the scores `[b, heads, s, s]` and casts them to fp32 for the
softmax: at 4096 tokens that alone is 1 GiB per micro-batch row and layer. SDPA computes

    out = softmax(q·kᵀ · scale + mask) · v

with the backend PyTorch's dispatcher picks for the shape, dtype and mask — flash, cuDNN or memory-efficient on a
GPU (no `s × s` tensor), its flash kernel on CPU (`models.kernels.sdpa_backend` names the one that runs). Grouped-
query attention is passed as is to the (causal, unmasked) flash kernel (`enable_gqa`: key/value heads are shared
by consecutive query heads, as in Megatron's `repeat_interleave`); with an explicit mask, keys and values are
repeated per query head for the memory-efficient kernel.

Packed sequences (`packed_seq_params`, THD, `models.packing`): causal attention inside each sequence of the pack.

Masks follow Megatron: a boolean `attention_mask` broadcastable to `[b, 1, sq, sk]`, True where attention is NOT
allowed. Without a mask, `AttnMaskType.causal` means the causal mask (passed to the kernel as `is_causal`, which
keeps the flash path). A query row with no allowed key (a padding row) gives a zero output here, where Megatron
gives the mean of all values; such rows carry no loss.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


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
        inside each segment [cu_seqlens_q_padded[i], cu_seqlens_q_padded[i + 1]) of the pack, one SDPA call per
        segment (its flash path, `is_causal`): on CPU 3–4× faster, forward and backward, than one call with a
        block-diagonal causal mask over the whole pack (16 sequences of 8–512 tokens, bench/bench_packing.py
        measures both), which computes all t² scores. Returns `[t, np·hn]`.

        The segments are `torch.split` views of the token dimension (each `[p_i, heads, hn]` contiguous, seen as
        `[1, heads, p_i, hn]` by SDPA, as the padded path's permuted rows are): the backward concatenates their
        gradients once per tensor, where slicing each segment out would cost a zeroed full-pack gradient per
        segment and a sum of them (O(segments · t) per layer). The bounds come from the host
        (`HostPackedSeqParams.segment_bounds`) when the pack has them, else from cu_seqlens (a device read)."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPA core attention takes packed sequences in the thd format, not {params.qkv_format}")
        bounds = getattr(params, "segment_bounds", ())
        if not bounds:
            cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
            bounds = cu.tolist()
        if bounds[-1] != query.shape[0]:
            raise ValueError(f"the pack's segments cover {bounds[-1]} tokens, the query holds {query.shape[0]}")
        sizes = [end - start for start, end in itertools.pairwise(bounds)]
        dropout = self.dropout if self.training else 0.0
        grouped = self.heads_per_partition != self.groups_per_partition
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
