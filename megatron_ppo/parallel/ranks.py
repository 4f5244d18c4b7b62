"""This process's place in Megatron's process groups, for the code outside `models/` and `parallel/` (the trainer,
the conversion, the task's SFT), which never reads `megatron.core.parallel_state` itself.

Each group is (size, rank): `data_parallel` (the replicas a batch is shared over), `tensor_parallel`, and for the
experts `expert_parallel` (which experts a rank holds) and `expert_tensor_parallel` (each expert's TP split).
"""

from __future__ import annotations

from typing import NamedTuple

from megatron.core import parallel_state


class GroupPosition(NamedTuple):
    size: int
    rank: int


def data_parallel() -> GroupPosition:
    return GroupPosition(parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank())


def tensor_parallel() -> GroupPosition:
    return GroupPosition(
        parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    )


def expert_parallel() -> GroupPosition:
    return GroupPosition(
        parallel_state.get_expert_model_parallel_world_size(), parallel_state.get_expert_model_parallel_rank()
    )


def expert_tensor_parallel() -> GroupPosition:
    return GroupPosition(
        parallel_state.get_expert_tensor_parallel_world_size(), parallel_state.get_expert_tensor_parallel_rank()
    )


def pipeline_stage() -> int:
    return parallel_state.get_pipeline_model_parallel_rank()


def is_first_of_last_stage() -> bool:
    """Whether this rank reports for the whole model: the last pipeline stage's first tensor- and data-parallel
    rank (one such rank per job)."""
    return (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and tensor_parallel().rank == 0
        and data_parallel().rank == 0
    )


def describe_rank() -> str:
    """`tensor-parallel rank 1, pipeline stage 0, data-parallel rank 3` (the launch log's line per process)."""
    return (
        f"tensor-parallel rank {tensor_parallel().rank}, pipeline stage {pipeline_stage()}, data-parallel rank "
        f"{data_parallel().rank}"
    )
