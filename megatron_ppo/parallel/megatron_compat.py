"""Differences between the megatron-core releases the package admits (0.16.1 to 0.19.x), each bent once here,
named by the release it follows; how this package hands Megatron's checkpoint writer its results queue
(synchronous and asynchronous saves); and RoPE on a pack of sequences from per-token positions (`rotary_per_token`),
where every release admitted loops over the pack's sequences with host reads.
Device stand-ins (Megatron on a machine without CUDA) are `cpu_compat`'s job."""

from __future__ import annotations

import contextlib
import inspect
import os
import pickle
import queue
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import megatron.core
import torch
from megatron.core import parallel_state
from megatron.core import utils as megatron_utils
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import attention as megatron_attention

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


def writing_first_in_the_writer(
    request: Any, write: Callable[[], None], then: Callable[[list[Path]], None] = lambda shards: None
) -> Any:
    """`request` (an `AsyncRequest`) whose writer process runs `write` (the save's small files) before the shards
    and `then` with the paths of the shard files it wrote after them (their digests), so that the trainer waits for
    neither: under the fork the writer starts from, the small files are what the trainer held when it scheduled the
    save. A failure of `write` is reported as a failed write of the shards would be, and the shards are not
    written: Megatron's writer function takes (rank, write buckets, results queue) in every release admitted, and an
    exception put on that queue is raised by Megatron's finalisation on every rank. `then` runs after the writer
    has put its one result on that queue, so a failure of it is not reported there: what it would have recorded is
    left undone (the manifest's writer hashes what no rank did). On a rank with no shards to write (no writer
    process) both run at once. The writer runs at `WRITER_NICENESS`."""
    shards = request.async_fn
    if shards is None:
        write()
        then([])
        return request

    def write_then_shards(*args: Any, **kwargs: Any) -> None:
        os.nice(WRITER_NICENESS)
        try:
            write()
        except Exception as error:  # the writer process's own failure, as Megatron's writer reports its own
            args[2].put(error)
            return
        shards(*args, **kwargs)
        with contextlib.suppress(Exception):
            then([Path(bucket[0]) for bucket in args[1]])

    return request._replace(async_fn=write_then_shards)


def rotary_per_token(gpt: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """RoPE on a pack (THD) rotated once, from per-token positions, with no loop over its sequences and no host read.

    Every release admitted (0.16.1 to 0.19.x) rotates a pack's queries and keys in each layer with
    `rope_utils._apply_rotary_pos_emb_thd` unless Transformer Engine's fused RoPE is on: it reads `cu_seqlens` on the
    host (`.tolist()`, and `.item()` per sequence or for the total), four device→host syncs per layer on a GPU, and
    0.19 rotates sequence by sequence. Here the pack's angles are gathered once per forward of `gpt` (a
    `GPTModel`), shared by its layers,

        freqs_pack = freqs[position_ids]        [T, 1, 1, d]   (freqs [max_seqlen, 1, 1, d], Megatron's table)

    from the position ids the chunk is called with (`models.packing.Pack.position_ids`: restarting at each
    sequence; the same ids its learned position embedding reads on the first stage), and each layer rotates the
    whole pack at once with Megatron's own non-packed RoPE (`apply_rotary_pos_emb` without cu_seqlens: fused when
    `apply_rope_fusion` is on, else `_apply_rotary_pos_emb_bshd`) on the pack seen as `[T, 1, heads, d]`:

        rope(t)[j] = t[j]·cos(freqs_pack[j]) + rotate_half(t[j])·sin(freqs_pack[j])

    which is Megatron's THD rotation token for token (a token j of segment i at position p_j = j − start_i gets
    freqs[p_j] there too). It is also what Megatron computes when its `freqs` cover the whole pack ("CASE 1" of
    0.19's `_apply_rotary_pos_emb_thd`, offsets per sequence) without context parallelism, so the attention module's
    `apply_rotary_pos_emb` is replaced (once per process) by `apply_rotary_pos_emb_whole_pack`, which takes that
    case whole-pack and hands every other call to Megatron unchanged.
    Only Megatron's plain `RotaryEmbedding` (`position_embedding_type: rope`) is served; a chunk without one (learned
    positions, a later pipeline stage without RoPE) gets no hooks. Returns the hooks' handles."""
    rotary = getattr(gpt, "rotary_pos_emb", None)
    if type(rotary) is not RotaryEmbedding:
        return []
    if megatron_attention.apply_rotary_pos_emb is not apply_rotary_pos_emb_whole_pack:
        megatron_attention.apply_rotary_pos_emb = apply_rotary_pos_emb_whole_pack
    pack_positions: list[torch.Tensor | None] = [None]  # this forward's per-token positions [T], None unpacked

    def take_positions(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        params = kwargs.get("packed_seq_params")
        positions = kwargs["position_ids"] if "position_ids" in kwargs else args[1] if len(args) > 1 else None
        thd = params is not None and params.qkv_format == "thd" and positions is not None
        pack_positions[0] = positions.reshape(-1) if thd else None

    def per_token(_module: torch.nn.Module, _args: tuple, kwargs: dict, freqs: torch.Tensor) -> torch.Tensor | None:
        positions = pack_positions[0]
        if positions is None or not kwargs.get("packed_seq", False):
            return None
        return freqs.index_select(0, positions)

    return [
        gpt.register_forward_pre_hook(take_positions, with_kwargs=True),
        rotary.register_forward_hook(per_token, with_kwargs=True),
    ]


def apply_rotary_pos_emb_whole_pack(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
    **kwargs: Any,
) -> torch.Tensor:
    """Megatron's `apply_rotary_pos_emb` (same arguments), with a pack `t` `[T, heads, d]` whose `freqs` hold one
    angle row per token (`[T, 1, 1, d]`, `rotary_per_token`) rotated whole, as the non-packed `[T, 1, heads, d]`:
    no host read. Without context parallelism only (a CP rank's freqs would need its share of each sequence);
    every other call is Megatron's."""
    group = cp_group if cp_group is not None else parallel_state.get_context_parallel_group()
    if cu_seqlens is not None and freqs.dim() >= 1 and freqs.size(0) == t.size(0) and group.size() == 1:
        return rope_utils.apply_rotary_pos_emb(t.unsqueeze(1), freqs, config, None, mscale, group, **kwargs).squeeze(1)
    return rope_utils.apply_rotary_pos_emb(t, freqs, config, cu_seqlens, mscale, group, **kwargs)
