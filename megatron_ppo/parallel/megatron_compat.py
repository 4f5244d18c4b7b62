"""Differences between the megatron-core releases the package admits (0.16.1 to 0.19.x), each bent once here,
named by the release it follows, and how this package hands Megatron's checkpoint writer its results queue
(synchronous and asynchronous saves).
Device stand-ins (Megatron on a machine without CUDA) are `cpu_compat`'s job."""

from __future__ import annotations

import inspect
import os
import pickle
import queue
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
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


def packed_seq_fields() -> frozenset[str]:
    """The fields of Megatron's `PackedSeqParams` in this release: megatron-core 0.19 added `pad_between_seqs`,
    which it hands Transformer Engine ≥ 2.2 (`TEDotProductAttention`); without it TE infers the flag with a
    `torch.equal` of the device's cu_seqlens in every attention layer (a host sync each, TE 2.8–2.12)."""
    import dataclasses

    from megatron.core.packed_seq_params import PackedSeqParams

    return frozenset(field.name for field in dataclasses.fields(PackedSeqParams))


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


class ForkedWriterResults:
    """The one `put` / `get_nowait` pair Megatron's checkpoint writer asks of its results queue, across a fork:
    `put` in a writer process forked from this one, `get_nowait` here. Each item is one pickle file in a private
    temporary directory (written whole, then renamed into place), read back oldest first. A pipe (a
    `multiprocessing.Queue`) would hold a writer back at its exit until its results are read, and they are read
    only once it has exited; a `multiprocessing.Manager` queue is a server process holding copies of the
    process-group sockets, which then stall the group's teardown (~50 s per run at two ranks on the CPU)."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="megatron-ppo-write-results-")
        weakref.finalize(self, shutil.rmtree, self.directory, True)

    def put(self, item: Any) -> None:
        name = f"{time.time_ns():020d}-{os.getpid()}"
        partial = os.path.join(self.directory, f".{name}")
        with open(partial, "wb") as file:
            pickle.dump(item, file)
        os.replace(partial, os.path.join(self.directory, name))

    def get_nowait(self) -> Any:
        names = sorted(name for name in os.listdir(self.directory) if not name.startswith("."))
        if not names:
            raise queue.Empty
        path = os.path.join(self.directory, names[0])
        with open(path, "rb") as file:
            item = pickle.load(file)
        os.unlink(path)
        return item


def checkpoint_writes_in_a_forked_process() -> None:
    """Asynchronous saves: Megatron's writer runs in a process forked from the trainer (`TemporalAsyncCaller`),
    which hands its write results back on the module's `_results_queue`; a queue of this process (what
    `checkpoint_writes_in_process` sets) never reaches back from the child, so it becomes a `ForkedWriterResults`
    (synchronous saves use it as well). Set before the first asynchronous save; every release admitted keeps the
    queue in the module global `_results_queue` and asks only `put` and `get_nowait` of it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, ForkedWriterResults):
        filesystem_async._results_queue = ForkedWriterResults()


def async_save_request(
    sharded_state_dict: dict[str, Any], checkpoint_dir: str, strategy: Any = None, validate: bool = True
) -> Any:
    """Start Megatron's asynchronous `dist_checkpointing.save` of `sharded_state_dict` (the plan, made now) and
    return the `AsyncRequest` that writes it (`AsyncCallsQueue.schedule_async_request`) and finalises it (the global
    metadata, `metadata.json`). `strategy`: Megatron's save strategy (None: a fresh default one;
    `constant_structure_save_strategy` keeps its plans across saves); `validate`: check that every shard is saved
    exactly once (an all-gather of every rank's shard metadata), needed once per sharded structure.
    megatron-core 0.19 has an `async_strategy` argument whose default is NVIDIA Resiliency Extension's writer
    (`nvrx`, a package we do not require); 0.16.1 has no such argument and only megatron-core's own writer
    (`mcore`), which every release admitted has: that one is asked for."""
    from megatron.core import dist_checkpointing

    checkpoint_writes_in_a_forked_process()
    takes_strategy = "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    kwargs = {"async_strategy": "mcore"} if takes_strategy else {}
    return dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy=strategy,
                                   validate_access_integrity=validate, async_sharded_save=True, **kwargs)  # fmt: skip


def constant_structure_save_strategy() -> Any:
    """Megatron's `torch_dist` save strategy with its save plans cached (`cached_metadata`, what Megatron-LM's
    `--ckpt-assume-constant-structure` sets): kept across saves of one sharded structure, its second save checks
    that the plan has not changed and from its third on each rank reuses its local plan and rank 0 the global
    metadata, with no plan exchange between the ranks. A fresh instance, never the registry's shared default
    (0.16.1's `get_default_save_sharded_strategy` returns that one). Same arguments in every release admitted."""
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    return TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=True)


# The writer process's niceness: where it shares the training ranks' cores (the CPU runs), the training goes first
WRITER_NICENESS = 10


def writing_first_in_the_writer(request: Any, write: Callable[[], None]) -> Any:
    """`request` (an `AsyncRequest`) whose writer process runs `write` (the save's small files) before the shards,
    so that the trainer does not wait for them: under the fork the writer starts from, they are what the trainer
    held when it scheduled the save. A failure of `write` is reported as a failed write of the shards would be, and
    the shards are not written: Megatron's writer function takes (rank, write buckets, results queue) in every
    release admitted, and an exception put on that queue is raised by Megatron's finalisation on every rank. On a
    rank with no shards to write (no writer process) `write` runs at once. The writer runs at `WRITER_NICENESS`."""
    shards = request.async_fn
    if shards is None:
        write()
        return request

    def write_then_shards(*args: Any, **kwargs: Any) -> None:
        os.nice(WRITER_NICENESS)
        try:
            write()
        except Exception as error:  # the writer process's own failure, as Megatron's writer reports its own
            args[2].put(error)
            return
        shards(*args, **kwargs)

    return request._replace(async_fn=write_then_shards)
