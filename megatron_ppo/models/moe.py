"""What a mixture-of-experts model needs around Megatron's MoE layers: equal token counts across the
expert-parallel ranks for the allgather dispatcher, and the router's load-balancing loss read back for logging.

Megatron's allgather dispatcher gathers every token of the TP × EP group into one buffer of equal slices, so the
ranks of an expert-parallel group — different data-parallel replicas, with different micro-batches — must feed
it micro-batches of the same `[b, s]`. `expert_parallel_widths` agrees on one width per micro-batch (the
longest over the group); the schedule pads the tokens to it on the right (causal attention: the real positions
never see the padding) and cuts the last stage's output back before the loss. The alltoall dispatcher exchanges
token counts itself and needs none of this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    track_moe_metrics,
)

MOE_AUX_LOSS = "load_balancing_loss"  # the router's name in Megatron's aux-loss tracker


def expert_parallel_widths(config: TransformerConfig, widths: Sequence[int]) -> list[int] | None:
    """The width each micro-batch is padded to so that every rank of this rank's expert-parallel group feeds the
    allgather dispatcher the same token count: the longest of the group, micro-batch by micro-batch. None when
    nothing needs padding (dense model, EP = 1, or the alltoall dispatcher). The ranks must run the same number of
    micro-batches (fixed micro-batches of equal data-parallel shares; validation refuses dynamic batching here)."""
    if not config.num_moe_experts or config.moe_token_dispatcher_type != "allgather":
        return None
    group = parallel_state.get_expert_model_parallel_group()
    if dist.get_world_size(group) == 1:
        return None
    counts = torch.tensor([len(widths), -len(widths)])
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if counts[0] != -counts[1]:
        raise RuntimeError(
            f"expert-parallel ranks run {-int(counts[1])} to {int(counts[0])} micro-batches; the allgather MoE "
            "dispatcher needs the same number on each: use fixed micro-batches (use_dynamic_bsz=false) and a "
            "batch size divisible by the data-parallel size, or the alltoall dispatcher on GPU"
        )
    longest = torch.tensor(list(widths), dtype=torch.long)
    dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=group)
    return longest.tolist()


def pad_tokens(
    input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`[b, s]` tokens and positions right-padded to `[b, width]` (token 0, positions continuing), and a boolean
    mask `[b, 1, s, s]` (True: not allowed) extended causally to `[b, 1, width, width]`."""
    pad = width - input_ids.shape[1]
    if pad == 0:
        return input_ids, position_ids, attention_mask
    steps = torch.arange(1, pad + 1, device=position_ids.device)
    position_ids = torch.cat([position_ids, position_ids[:, -1:] + steps], dim=1)
    if attention_mask is not None:
        causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).triu(1)
        causal = causal.expand(attention_mask.shape[0], 1, width, width).clone()
        causal[..., : width - pad, : width - pad] = attention_mask
        attention_mask = causal
    return F.pad(input_ids, (0, pad)), position_ids, attention_mask


def clear_moe_aux_losses() -> None:
    """Forget the load-balancing losses recorded so far (Megatron's routers add to them in every training forward)."""
    clear_aux_losses_tracker()


def moe_aux_loss_metrics(role: str, config: TransformerConfig, num_micro_batches: int) -> dict[str, float]:
    """`{role}/moe_aux_loss`: the routers' load-balancing loss of the last forward-backward, before its coefficient,
    as Megatron-LM logs it (`track_moe_metrics`): per layer summed over the pipeline stages and the TP × CP ranks
    that share a sequence, averaged over micro-batches and data-parallel replicas, then averaged over the MoE layers.
    1.0 is perfectly balanced routing. The loss already entered the backward through Megatron's
    `MoEAuxLossAutoScaler` (scale 1 / micro-batches), so it is logged here and not added again. Collective over the
    model's groups; empty for a dense model, a zero coefficient or when no router recorded a loss. Clears the record."""
    if (
        not config.num_moe_experts
        or not config.moe_aux_loss_coeff
        or MOE_AUX_LOSS not in get_moe_layer_wise_logging_tracker()
    ):
        return {}
    totals: dict[str, torch.Tensor] = {}
    track_moe_metrics(
        loss_scale=1.0 / num_micro_batches,
        iteration=0,
        total_loss_dict=totals,
        track_names=[MOE_AUX_LOSS],
        num_layers=config.num_layers,
    )
    return {f"{role}/moe_aux_loss": float(totals[MOE_AUX_LOSS])}
