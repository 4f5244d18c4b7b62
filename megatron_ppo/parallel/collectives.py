"""Moving results between the ranks of the trainer's groups: per-row tensors with tensor collectives (the hot
path: experience over data-parallel ranks), small Python objects (metrics) with object collectives.

Last-stage results (log-probs, values, metrics, sampled tokens) exist only on the last pipeline stage; experience
is computed per data-parallel replica and then shared so that advantages are whitened over the whole batch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state


def is_last_stage() -> bool:
    return parallel_state.is_pipeline_last_stage(ignore_virtual=True)


def broadcast_from_last_stage(obj: Any) -> Any:
    """`obj` as held by the last pipeline stage, on every stage of this rank's pipeline."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(
        box,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return box[0]


def broadcast_from_rank0(obj: Any) -> Any:
    """`obj` as global rank 0 holds it, on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def data_parallel_share(num_items: int) -> list[int]:
    """The indices of `num_items` this data-parallel rank handles (strided, so shares differ by at most one)."""
    return list(
        range(parallel_state.get_data_parallel_rank(), num_items, parallel_state.get_data_parallel_world_size())
    )


def dynamic_micro_batch_count(own: int) -> int:
    """The number of token-budget micro-batches every rank of this data-parallel group runs, given this rank's own
    packing's `own`: the largest over the group (each MoE layer's token all-to-all is a collective across data-parallel
    replicas, so they must run the same number of forward passes), rounded up to a multiple of PP under the
    interleaved schedule with virtual stages (Megatron's `microbatch_group_size_per_vp_stage`, PP by default).
    verl's `rearrange_micro_batches` does the same (`same_micro_num_in_dp`, `num_batches_divided_by`)."""
    count = torch.tensor([own], device="cuda" if torch.cuda.is_available() else "cpu")
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
    group = parallel_state.get_pipeline_model_parallel_world_size()
    if (parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        return -(-int(count.item()) // group) * group
    return int(count.item())


def gather_data_parallel(obj: Any, with_context_parallel: bool = False) -> list[Any]:
    """Every data-parallel rank's `obj`, in data-parallel rank order (with `with_context_parallel`, every rank of
    the DP×CP group: each CP rank holds part of every sequence)."""
    world = parallel_state.get_data_parallel_world_size(with_context_parallel=with_context_parallel)
    if world == 1:
        return [obj]
    gathered: list[Any] = [None] * world
    group = parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel)
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def undo_share(parts: list[list[Any]]) -> list[Any]:
    """Interleave per-rank lists produced from `data_parallel_share` back into the original order."""
    total = sum(len(p) for p in parts)
    out: list[Any] = [None] * total
    for rank, part in enumerate(parts):
        out[rank :: len(parts)] = part
    return out


def global_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on at least one (a MAX all-reduce over the whole job)."""
    value = torch.tensor([1.0 if flag else 0.0], device="cuda" if torch.cuda.is_available() else "cpu")
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item() > 0


def first_failure(failure: Any) -> tuple[int, Any] | None:
    """(rank, its `failure`) of the lowest rank whose `failure` is not None, on every rank; None when no rank
    failed (a flag all-reduce over the whole job, and only when some rank failed an object all-gather)."""
    failures = [failure]
    if dist.is_initialized() and dist.get_world_size() > 1:
        if not any_rank(failure is not None):
            return None
        failures = [None] * dist.get_world_size()
        dist.all_gather_object(failures, failure)
    return next(((rank, f) for rank, f in enumerate(failures) if f is not None), None)


def host_group(timeout_s: float) -> dist.ProcessGroup | None:
    """A gloo group of the whole job whose collectives give up after `timeout_s` (None when not distributed): a
    flag agreed there costs no device synchronisation, and a rank whose peers never arrive — they wait in a
    collective of the device group that this rank will not issue — gets an error instead of a hang. Collective:
    every rank creates it at the same point."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def any_and_every_rank_within(flag: bool, group: dist.ProcessGroup | None) -> tuple[bool, bool] | None:
    """(whether `flag` is true on some rank, whether on every rank) over `group` (`host_group`), on every rank that
    arrives; None when some rank did not arrive within the group's timeout (or has gone): the ranks cannot agree."""
    if group is None:
        return flag, flag
    value = torch.tensor([1.0 if flag else 0.0, 0.0 if flag else 1.0])
    try:
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    except RuntimeError:  # gloo: "Timed out waiting …" or "Connection closed by peer"
        return None
    return value[0].item() > 0, value[1].item() == 0


def broadcast_tensor_from_last_stage(tensor: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's `tensor` on every stage of this rank's pipeline. Other stages pass `None` and
    receive into a new tensor of `like`'s shape, dtype and device."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        assert tensor is not None, "a single pipeline stage is the last stage"
        return tensor
    buffer = tensor.contiguous() if is_last_stage() else torch.empty_like(like)
    dist.broadcast(
        buffer,
        src=parallel_state.get_pipeline_model_parallel_last_rank(),
        group=parallel_state.get_pipeline_model_parallel_group(),
    )
    return buffer


def gather_rows_data_parallel(rows: torch.Tensor, num_items: int) -> torch.Tensor:
    """All `num_items` rows `[num_items, ...]` in their original order, from each data-parallel rank's strided share
    `rows` (`[len(data_parallel_share(num_items)), ...]`, same trailing shape and device on every rank).

    A tensor collective (no pickling, stays on the GPU): each share is padded to ⌈num_items / DP⌉ rows, gathered,
    and item i is read from rank i mod DP, position i div DP.
    """
    world = parallel_state.get_data_parallel_world_size()
    if world == 1:
        return rows
    per_rank = -(-num_items // world)
    padded = rows.new_zeros((per_rank, *rows.shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=parallel_state.get_data_parallel_group())
    return torch.stack(parts, dim=1).flatten(0, 1)[:num_items]
