"""Differences between the megatron-core releases the package admits (0.16.1 to 0.19.x), each bent once here,
named by the release it follows, and the one Megatron default bent for how this package saves (synchronously).
Device stand-ins (Megatron on a machine without CUDA) are `cpu_compat`'s job."""

from __future__ import annotations

import inspect
import queue
from typing import Any

import megatron.core
from megatron.core import utils as megatron_utils

MEGATRON_CORE_VERSION: str = megatron.core.__version__


def bind_missing_te_general_gemm() -> None:
    """megatron-core < 0.17 (0.16.1) binds `te_general_gemm` in its MoE utilities only when Transformer Engine
    imports, yet every router forward reads the name (a NameError on any machine without TE, GPU or not);
    0.17 and later bind it to None there. None selects the router's torch GEMM. A no-op where the name exists."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


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
