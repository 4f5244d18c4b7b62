"""Forward (and backward) over micro-batches through Megatron's pipeline schedule, with our loss on the last stage.

`run_micro_batches` moves each micro-batch to the model's device (pinned host memory, `non_blocking`), hands it to
`get_forward_backward_func()` — no pipelining, 1F1B, or the interleaved schedule with virtual stages — and calls
`loss_fn(micro_batch, output)` on the last stage, where `output` is the model's last-stage output
`[batch, seq, vocab/TP]` (actor/ref) or `[batch, seq, 1]` (critic).

Loss normalisation: `loss_fn` must return the micro-batch's share of the mini-batch loss, normalised by global
counts and multiplied by the data-parallel size (as `megatron_ppo.algo.agg_loss(..., dp_size=DP,
batch_num_tokens=N_global)` does). Megatron divides each micro-batch loss by the number of micro-batches and
multiplies it by the context-parallel size, and its DDP averages gradients over DP×CP ranks; this module
multiplies by the number of micro-batches, so the gradient is exactly ∇(Σ_global / N_global) — with context
parallelism too, where the CP factor balances DDP's division by CP (`megatron_ppo.models.context_parallel`).

Context parallelism (CP > 1): the model and `loss_fn` see this CP rank's load-balanced tokens of every per-token
tensor of the micro-batch; tensors `[b, s_local, ...]` that `loss_fn` returns in its results (per-token outputs of
a forward-only pass) come back gathered over the CP group as full rows `[b, W, ...]`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ppo.models.context_parallel import chunk_positions, gather_per_token, split_micro_batch
from megatron_ppo.models.gpt import RoleModel, logits_cut, unwrap
from megatron_ppo.models.moe import (
    expert_parallel_micro_batch_count,
    expert_parallel_shapes,
    pad_tokens,
    routing_padding_mask,
)
from megatron_ppo.models.packing import PACK, Pack, build_pack, packed_width
from megatron_ppo.models.router_replay import Action, RouterReplayBinding
from megatron_ppo.models.widths import padded_width, pass_shape
from megatron_ppo.parallel.device import module_device, to_device

logger = logging.getLogger(__name__)
MicroBatch = dict[str, torch.Tensor]
LossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, Any]]]


def causal_attention_mask(seq_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Megatron's boolean mask `[1, 1, s, s]`, True where attention is *not* allowed (the future)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def run_micro_batches(
    model: RoleModel,
    micro_batches: Sequence[MicroBatch],
    loss_fn: LossFn,
    *,
    forward_only: bool,
    inference_context: StaticInferenceContext | None = None,
    routing: Action | None = None,
) -> list[dict[str, Any]]:
    """Run the schedule over `micro_batches` (each with `input_ids` `[b, s]`, optional `position_ids` and a boolean
    `attention_mask` `[b, 1, s, s]`, True where attention is not allowed; causal without one); `loss_fn` sees the
    micro-batch on the model's device. Returns, on the last pipeline stage, the metrics dict `loss_fn` gave for each
    micro-batch (an empty list on other stages). Gradients accumulate in the DDP buffers when not `forward_only`.
    The model's inputs are padded below and to the right to the shapes of `model_shapes` (the layout's and the
    bucket's width, the expert-parallel group's shape, one shape per pipeline pass); the last stage's output is
    cut back to the micro-batch's own `[b, s]` (this CP rank's tokens of it) before `loss_fn`, so no padding enters
    a loss, a metric or a log-prob. The tokens the model computed and the real ones go to `model.padding`.

    Packed (`model.pack_sequences`, and micro-batches that carry their rows' `lengths`; generation's do not): each
    micro-batch enters as one `[1, T]` pack of its whole sequences (`models.packing`), T the pack's tokens rounded
    to the layout's multiple and the bucket; with PP every pack of the pass has the largest T, so the pass has one
    shape and `variable_seq_lengths` stays off. `loss_fn` gets the packed output `[1, T, …]` and the micro-batch
    with its `Pack` under `models.packing.PACK`, and turns per-token results back into rows (`per_row`).

    A pass runs as many micro-batches as the largest count of its expert-parallel group (MoE's allgather
    dispatcher is a collective per micro-batch) and, under the interleaved schedule (virtual stages), a multiple of
    PP (Megatron refuses fewer and uneven remainders): a rank with fewer runs empty micro-batches (one padding
    token, no loss, no result).

    With an `inference_context` (KV-cached decoding, `models.generation`): the micro-batches, all of one shape,
    enter unpadded (padding would enter the cache), micro-batch i writing rows `[i·b, (i+1)·b)` of the cache; the
    last stage's output holds the TP-gathered logits of the last position only (`[b, 1, vocab]`).

    `routing` (a model with `router_replay`): "record" keeps every micro-batch's routes for
    `model.router_replay.collect`; "replay" routes each micro-batch as its `routed_experts` say
    (`models.router_replay`; an empty micro-batch has no record and routes to the fallback experts, so each
    forward still queues one target for its recomputing backward). Either way the routers route live again after
    the pass."""
    real_micro_batches = len(micro_batches)
    micro_batches = [*micro_batches, *_empty_micro_batches(model, real_micro_batches)]
    num_micro_batches = len(micro_batches)
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    sp_tp = model.config.tensor_model_parallel_size if model.config.sequence_parallel else 1
    device = module_device(model.chunks[0], f"the {model.role} model")
    packable = inference_context is None and all("lengths" in batch for batch in micro_batches)
    multiple = model.pack_multiple if packable else None
    if multiple is not None:  # packed: one host read of the pass's lengths (cu_seqlens are host arithmetic)
        lengths = _pass_lengths(micro_batches)
        own_shapes = [(1, packed_width(rows, multiple, model.width_multiple)) for rows in lengths]
    else:
        own_shapes = [tuple(batch["input_ids"].shape) for batch in micro_batches]
    if inference_context is None:
        shapes = model_shapes(model, own_shapes, cp_size, sp_tp)
        _note_pass_shapes(model, packed=multiple is not None)
    else:
        if len(set(own_shapes)) != 1 or cp_size > 1 or model.config.sequence_parallel:
            raise ValueError(f"a cached pass takes micro-batches of one shape (got {sorted(set(own_shapes))}), "
                             "without context or sequence parallelism")  # fmt: skip
        shapes, model.config.variable_seq_lengths = own_shapes, False
    micro_batch_size, seq_length = (max(sizes) for sizes in zip(*shapes, strict=True))
    packs = None
    if multiple is not None:
        packs = [build_pack(rows, batch["input_ids"].shape[1], multiple, width, device)
                 for rows, batch, (_, width) in zip(lengths, micro_batches, shapes, strict=True)]  # fmt: skip
    for batch, (rows, width) in zip(micro_batches, shapes, strict=True):
        lengths_of = batch.get("lengths")
        model.padding.add(rows * width, lengths_of.sum() if lengths_of is not None else batch["input_ids"].numel())

    def forward_step(data_iterator, chunk):
        index, batch = next(data_iterator)
        batch = to_device(batch, device, f"the {model.role} model's forward")
        if packs is not None:
            output, loss = _packed_forward(model, chunk, batch, packs[index], loss_fn, num_micro_batches, replay,
                                           index, keep=index < real_micro_batches)  # fmt: skip
            if index >= real_micro_batches:  # an empty micro-batch of the interleaved schedule: no loss, no result
                return output, lambda output: (output.sum() * 0.0, {})
            return output, loss
        if cp_size > 1:  # every per-token tensor padded to the pass's width, then this CP rank's chunks taken
            batch = split_micro_batch(batch, cp_size, cp_rank, sp_tp, full_width=shapes[index][1])
        input_ids = batch["input_ids"]
        position_ids = batch.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=device).expand_as(input_ids)
        # no mask: causal attention by the layers' mask type (the flash path of SDPA / TE, no [s, s] tensor)
        attention_mask = batch.get("attention_mask")
        rows, width = input_ids.shape
        input_ids, position_ids, attention_mask = pad_tokens(
            input_ids, position_ids, attention_mask, (shapes[index][0], shapes[index][1] // cp_size)
        )
        extra = {}
        if model.config.num_moe_experts:  # padding stays out of the routers' load-balancing statistics
            full_width = micro_batches[index]["input_ids"].shape[1]
            lengths = batch.get("lengths", torch.full((rows,), full_width, device=device))
            # with CP a rank's columns are its chunks of the pass's width, not a prefix of the row
            positions = chunk_positions(shapes[index][1], cp_size, cp_rank) if cp_size > 1 else None
            extra["padding_mask"] = routing_padding_mask(lengths, tuple(input_ids.shape), positions)
            if replay is not None:
                replay.before_forward(chunk, batch, tuple(input_ids.shape))
        if inference_context is not None:  # this micro-batch's rows of the cache; logits gathered over TP
            inference_context.batch_size_offset = index * rows
            extra.update(inference_context=inference_context, runtime_gather_output=True)
        # the vocabulary logits come for the real tokens only, as a tensor of their own (models.gpt.logits_cut);
        # a decoding step's are one token per row, cut below
        with logits_cut(chunk, rows, width) if inference_context is None else nullcontext():
            output = chunk(input_ids, position_ids, attention_mask, **extra)
        if replay is not None and (replay.action == "replay" or index < real_micro_batches):
            replay.after_forward(chunk, index, lengths, full_width, input_ids.shape[0], cp_size)
        if unwrap(chunk).post_process and tuple(output.shape[:2]) != (rows, width):
            # the critic's values `[rows, width, 1]`, a decoding step's logits: the padding stays out of every loss,
            # metric and output
            output = output[:rows, :width]
        if index >= real_micro_batches:  # an empty micro-batch of the interleaved schedule: no loss, no result
            return output, lambda output: (output.sum() * 0.0, {})
        return output, partial(_scaled_loss, loss_fn, batch, num_micro_batches)

    replay = model.router_replay if routing is not None else None
    if routing is not None and replay is None:
        raise ValueError(f"routing={routing!r}: the {model.role} model was built without routing replay")
    iterators = [iter(enumerate(micro_batches)) for _ in model.chunks]
    forward_backward = get_forward_backward_func()
    if replay is not None:
        replay.start(routing)
    try:
        with model.as_built():  # a LoRA actor's base reference: its adapters off for this pass
            results = forward_backward(
                forward_step_func=forward_step,
                data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=model.chunks if len(model.chunks) > 1 else model.chunks[0],
                num_microbatches=num_micro_batches,
                seq_length=seq_length,
                micro_batch_size=micro_batch_size,
                forward_only=forward_only,
            )
    finally:
        if replay is not None:
            replay.end_pass()
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return []
    results, micro_batches = list(results)[:real_micro_batches], micro_batches[:real_micro_batches]
    if cp_size > 1:
        group = parallel_state.get_context_parallel_group()
        widths = [batch["input_ids"].shape[1] for batch in micro_batches]
        results = [
            {k: gather_per_token(v, w, group) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v
             for k, v in result.items()}
            for result, w in zip(results, widths, strict=True)
        ]  # fmt: skip
    return list(results)


def _note_pass_shapes(model: RoleModel, packed: bool) -> None:
    """Log, once per kind of pass a role runs, how its micro-batches enter the model and whether its pipeline
    messages have one shape (`variable_seq_lengths` off) or exchange shapes first."""
    layout = "packed sequences [1, T] (THD)" if packed else "padded rows [b, s]"
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        pipeline = "no pipeline"
    elif model.config.variable_seq_lengths:
        pipeline = "several shapes per pipeline pass, exchanged before each message (variable_seq_lengths on)"
    else:
        pipeline = "one shape per pipeline pass (variable_seq_lengths off)"
    note = f"{model.role} passes: {layout}; {pipeline}"
    if note not in model.pass_notes:
        model.pass_notes.add(note)
        logger.info(note)


def _pass_lengths(micro_batches: Sequence[MicroBatch]) -> list[list[int]]:
    """Each micro-batch's row lengths, read to the host at once."""
    counts = [batch["input_ids"].shape[0] for batch in micro_batches]
    flat = torch.cat([batch["lengths"] for batch in micro_batches]).tolist()
    return [flat[sum(counts[:i]) : sum(counts[: i + 1])] for i in range(len(counts))]


def _packed_forward(model: RoleModel, chunk, batch: MicroBatch, pack: Pack, loss_fn: LossFn, num_micro_batches: int,
                    replay: RouterReplayBinding | None = None, index: int = 0, keep: bool = True):  # fmt: skip
    """One packed micro-batch through `chunk`: its rows as the `[1, T]` pack with THD `PackedSeqParams`, position
    ids restarting per sequence, MoE routers told which tokens are real; `loss_fn` gets the micro-batch with its
    `Pack` (under `models.packing.PACK`) and the packed output `[1, T, …]`, which it unpacks (`per_row`).
    `replay` (a pass that records or replays routes): the routers armed with the micro-batch's records at their
    pack positions, and the routes of micro-batch `index` kept by row (when `keep`: not an empty micro-batch)."""
    if batch.get("attention_mask") is not None:
        raise ValueError("packed sequences run causal attention inside each sequence, without an attention mask")
    input_ids = pack.pack(batch["input_ids"])
    kwargs: dict[str, Any] = {"packed_seq_params": pack.params}
    if model.config.num_moe_experts:  # padding stays out of the routers' load-balancing statistics
        kwargs["padding_mask"] = ~pack.token_is_real
        if replay is not None:
            replay.before_forward(chunk, batch, (1, pack.width), pack)
    output = chunk(input_ids, pack.position_ids, None, **kwargs)
    if replay is not None and (replay.action == "replay" or keep):
        replay.after_forward(chunk, index, batch["lengths"], batch["input_ids"].shape[1], 1, pack=pack)
    return output, partial(_scaled_loss, loss_fn, {**batch, PACK: pack}, num_micro_batches)


def _empty_micro_batches(model: RoleModel, count: int) -> list[MicroBatch]:
    """The micro-batches that bring a pass of `count` up to what every rank runs (`run_micro_batches`): the
    expert-parallel group's largest count, then, under virtual stages, a multiple of PP
    (`microbatch_group_size_per_vp_stage`, PP by default). Each holds one padding token (length 0: out of the
    routers' statistics); the pass's shape rule pads it like the others."""
    target = expert_parallel_micro_batch_count(model.config, count)
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    if (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        target = -(-target // pipeline) * pipeline
    empty = {"input_ids": torch.zeros(1, 1, dtype=torch.long), "lengths": torch.zeros(1, dtype=torch.long)}
    return [dict(empty) for _ in range(target - count)]


def model_shapes(
    model: RoleModel, shapes: Sequence[tuple[int, int]], cp_size: int, tp_for_sequence_parallel: int
) -> list[tuple[int, int]]:
    """The `(rows, width)` each micro-batch of one pass enters the model with (full rows: a CP rank holds
    width / CP of them), from the micro-batches' own `shapes`: each width rounded up by the layout's and the
    bucket's rule (`models.widths.padded_width`); without CP, for MoE's allgather dispatcher at EP > 1, the
    largest of the expert-parallel group (`models.moe`); with PP > 1, one shape for the whole pass
    (`models.widths.pass_shape`), so Megatron's pipeline messages need no shape exchange. Sets the model's
    `variable_seq_lengths` for the pass: on only where a pipeline pass keeps several shapes."""
    bucket = model.width_multiple
    own = [(rows, padded_width(width, cp_size, tp_for_sequence_parallel, bucket)) for rows, width in shapes]
    if cp_size == 1:
        own = expert_parallel_shapes(model.config, own) or own
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    one = pass_shape(own) if pipelined else None
    model.config.variable_seq_lengths = pipelined and one is None
    return [one] * len(own) if one is not None else own


def _scaled_loss(loss_fn: LossFn, batch: MicroBatch, num_micro_batches: int, output: torch.Tensor):
    """`loss_fn`'s loss × the number of micro-batches (undoing Megatron's division); Megatron's × CP stays: DDP
    divides it out again (module docstring)."""
    loss, metrics = loss_fn(batch, output)
    return loss * num_micro_batches, metrics
