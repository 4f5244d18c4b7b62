"""Differences between the megatron-core releases the package admits (0.16.1 to 0.19.x), each bent once here,
named by the release it follows, and two Megatron behaviours bent: how this package saves (synchronously), and
the pipeline shape exchange, which crosses its messages at PP = 2.
Device stand-ins (Megatron on a machine without CUDA) are `cpu_compat`'s job."""

from __future__ import annotations

import inspect
import queue
from typing import Any

import megatron.core
import torch
from megatron.core import utils as megatron_utils

MEGATRON_CORE_VERSION: str = megatron.core.__version__


def bind_missing_te_general_gemm() -> None:
    """megatron-core < 0.17 (0.16.1) binds `te_general_gemm` in its MoE utilities only when Transformer Engine
    imports, yet every router forward reads the name (a NameError on any machine without TE, GPU or not);
    0.17 and later bind it to None there. None selects the router's torch GEMM. A no-op where the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def exchange_pipeline_shapes_one_message_at_a_time() -> None:
    """Megatron's `P2PCommunicator._communicate_shapes` (every release admitted) posts its shape messages as one
    `batch_isend_irecv` in a fixed order, whatever `batch_p2p_comm` says. At PP = 2 both neighbours are one rank,
    and messages to one peer pair in posting order, so in the interleaved schedule's two-way exchanges the forward
    shape arrives as the backward one (NVIDIA/Megatron-LM#5100): gloo pairs them so, and NCCL pairs same-peer
    operations of a group in order too. The replacement sends them as Megatron's unbatched `_p2p_ops` sends its
    tensors (even ranks send first; at PP = 2 the two directions on two process groups), on either device."""
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    P2PCommunicator._communicate_shapes = _communicate_shapes_unbatched


def _communicate_shapes_unbatched(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next):
    from megatron.core.pipeline_parallel.p2p_communication import _p2p_ops

    device = torch.cuda.current_device()  # as Megatron allocates them (the CPU under `cpu_compat`)

    def shape_of(tensor):
        return None if tensor is None else torch.tensor(tensor.size(), dtype=torch.int64, device=device)

    recv_prev_shape = torch.empty(3, dtype=torch.int64, device=device) if recv_prev else None
    recv_next_shape = torch.empty(3, dtype=torch.int64, device=device) if recv_next else None
    requests = _p2p_ops(
        tensor_send_prev=shape_of(tensor_send_prev),
        tensor_recv_prev=recv_prev_shape,
        tensor_send_next=shape_of(tensor_send_next),
        tensor_recv_next=recv_next_shape,
        group=self.pp_group,
        prev_pipeline_rank=self.prev_rank,
        next_pipeline_rank=self.next_rank,
    )
    for request in requests.values():
        request.wait()
    return (
        [0, 0, 0] if recv_prev_shape is None else recv_prev_shape.tolist(),
        [0, 0, 0] if recv_next_shape is None else recv_next_shape.tolist(),
    )


def get_batch_on_this_cp_rank(batch: dict[str, Any], cp_group: Any) -> dict[str, Any]:
    """Megatron's load-balanced context-parallel slice of `batch`. megatron-core 0.18 added a positional
    `is_hybrid_cp` (before `cp_group`); plain context parallelism passes False."""
    function = megatron_utils.get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(function).parameters:
        return function(batch, False, cp_group=cp_group)
    return function(batch, cp_group=cp_group)


def checkpoint_writes_in_process() -> None:
    """Megatron's checkpoint writer hands its write results over a queue that it makes on the first save as a
    `multiprocessing.Manager` queue under the spawn context, for a writer in another process (asynchronous saves).
    A spawned Manager is a server process that imports this program again: ~5 s of CPU and ~1 GB of host memory per
    rank, for the run's whole life. Our saves are synchronous (the writer runs in the saving process; its helper
    threads or forks report to it on queues of their own), so a thread-safe queue of this process carries the
    results; set once, before that first save.
    Every release admitted keeps the queue in the module global `_results_queue`."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
