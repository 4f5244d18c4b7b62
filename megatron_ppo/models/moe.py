"""What a mixture-of-experts model needs around Megatron's MoE layers: equal token counts across the
expert-parallel ranks for the allgather dispatcher, and the router's load-balancing loss read back for logging.

Megatron's allgather dispatcher gathers every token of the expert TP × EP group into one buffer of equal slices,
so the ranks of that group — different data-parallel replicas, with different micro-batches — must feed
it micro-batches of the same `[b, s]`. `expert_parallel_shapes` agrees on one shape per micro-batch (the largest
over the group); the schedule pads the tokens to it (below and to the right: under causal attention the real
positions never see the padding) and cuts the last stage's output back before the loss; decoding loops stop
together (`finished_everywhere`). Padding — this and the batches' own — stays out of the load-balancing
statistics (`routing_padding_mask`). The alltoall dispatcher exchanges token counts itself and needs none of this.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
    track_moe_metrics,
)

from megatron_ppo.parallel.device import current_device

MOE_AUX_LOSS = "load_balancing_loss"  # the router's name in Megatron's aux-loss tracker


def equal_tokens_group(config: TransformerConfig) -> dist.ProcessGroup | None:
    """The expert TP × EP group, whose ranks must feed the allgather dispatcher the same `[b, s]` per forward, or
    None when nothing needs it (dense model, a group of one, or the alltoall dispatcher)."""
    if not config.num_moe_experts or config.moe_token_dispatcher_type != "allgather":
        return None
    group = parallel_state.get_expert_tensor_and_model_parallel_group()
    return group if dist.get_world_size(group) > 1 else None


def expert_parallel_micro_batch_count(config: TransformerConfig, count: int) -> int:
    """The number of micro-batches a pass runs on every rank of this rank's expert TP × EP group (the largest of the
    group's `count`s; ranks with fewer add empty ones, `models.schedule`); `count` where nothing needs it."""
    group = equal_tokens_group(config)
    if group is None:
        return count
    largest = torch.tensor([count], device=current_device())
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return int(largest.item())


def expert_parallel_shapes(
    config: TransformerConfig, shapes: Sequence[tuple[int, int]]
) -> list[tuple[int, int]] | None:
    """The `(rows, width)` each micro-batch is padded to so that every rank of this rank's expert TP × EP group
    feeds the allgather dispatcher the same token count: the largest of the group, micro-batch by micro-batch.
    None when nothing needs padding (`equal_tokens_group`). The ranks must run the same number of micro-batches:
    fixed micro-batches of equal data-parallel shares, or token-budget ones (`collectives.dynamic_micro_batch_count`
    gives every data-parallel rank the same count)."""
    group = equal_tokens_group(config)
    if group is None:
        return None
    device = current_device()  # NCCL reduces device tensors only
    counts = torch.tensor([len(shapes), -len(shapes)], device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
    if counts[0] != -counts[1]:
        raise RuntimeError(
            f"expert-parallel ranks run {-int(counts[1])} to {int(counts[0])} micro-batches; the allgather MoE "
            "dispatcher needs the same number on each: use fixed micro-batches (use_dynamic_bsz=false) and a "
            "batch size divisible by the data-parallel size, or the alltoall dispatcher on GPU"
        )
    largest = torch.tensor([list(shape) for shape in shapes], dtype=torch.long, device=device).reshape(-1, 2)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return [(rows, width) for rows, width in largest.tolist()]


def pad_tokens(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    shape: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`[b, s]` tokens and positions padded to `shape` = `[rows, width]` (token 0, position 0), and a boolean mask
    `[b, 1, s, s]` (True: not allowed) extended causally to `[rows, 1, width, width]`.
    Padding goes below and to the right: under causal attention no real position sees it, so any position id in
    range serves, and 0 is in range of every learned position table (the CUDA width bucket pads a 13-token row to
    128 columns, past the tiny recipe's 16-row table); RoPE reads no position ids (Megatron's GPTModel takes its
    rotary angles from the width)."""
    (b, s), (rows, width) = input_ids.shape, shape
    if (b, s) == (rows, width):
        return input_ids, position_ids, attention_mask
    padded_ids = input_ids.new_zeros(rows, width)
    padded_ids[:b, :s] = input_ids
    padded_positions = position_ids.new_zeros(rows, width)
    padded_positions[:b, :s] = position_ids
    if attention_mask is not None:
        causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).triu(1)
        padded_mask = causal.expand(rows, 1, width, width).clone()
        padded_mask[:b, :, :s, :s] = attention_mask
        attention_mask = padded_mask
    return padded_ids, padded_positions, attention_mask


def routing_padding_mask(
    lengths: torch.Tensor, shape: tuple[int, int], positions: torch.Tensor | None = None
) -> torch.Tensor:
    """`[rows, width]` boolean, True where a position holds no real token (at or beyond its row's length `[b]`, or
    in a padded row): Megatron's routers leave these out of the load-balancing statistics, as Hugging Face's loss
    leaves out masked tokens. `positions` `[width]`: each column's position in the full row (a context-parallel
    rank's chunks, `models.context_parallel.chunk_positions`); by default 0…width−1."""
    rows, width = shape
    real = lengths.new_zeros(rows)
    real[: lengths.shape[0]] = lengths
    if positions is None:
        positions = torch.arange(width, device=lengths.device)
    return positions.to(lengths.device)[None, :] >= real[:, None]


def finished_everywhere(config: TransformerConfig, finished: bool) -> bool:
    """Whether every rank of the expert-parallel group is `finished` (a decoding loop that stops early on one
    replica would leave the others waiting in the dispatcher); `finished` itself when nothing needs it."""
    group = equal_tokens_group(config)
    if group is None:
        return finished
    flag = torch.tensor([int(finished)], device=current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag)


def clear_moe_aux_losses() -> None:
    """Forget the load-balancing losses recorded so far (Megatron's routers add to them in every training forward)."""
    clear_aux_losses_tracker()


def moe_aux_loss_metrics(role: str, config: TransformerConfig, num_micro_batches: int) -> dict[str, float]:
    """`{role}/moe_aux_loss`: the routers' load-balancing loss of the last forward-backward, before its coefficient,
    as Megatron-LM logs it (`track_moe_metrics`): per layer summed over the pipeline stages and the TP × CP ranks
    that share a sequence, averaged over micro-batches and data-parallel replicas, then averaged over the MoE layers.
    About 1 for balanced routing (E·Σ_e f_e·P_e with f_e = P_e = 1/E). The loss already entered the backward
    through Megatron's `MoEAuxLossAutoScaler` (scale 1 / micro-batches), so it is logged here and not added again.
    Collective over the model's groups; empty for a dense model, a zero coefficient or when no router recorded a
    loss. Clears the record."""
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
