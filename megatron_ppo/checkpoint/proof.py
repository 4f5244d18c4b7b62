"""A checkpoint's bytes proven by every rank of the job together: rank 0 decides which checkpoint to load
(`run_start.start_run`, `CheckpointKeeper.loadable`), and each file it asks `verify.corruption` to read is read by one
rank, the files shared out by size (`verify.shares`) — at 16 nodes a 235B checkpoint's ~3 TB is read at 16 nodes'
bandwidth, not one process's.

    rank 0:                                   ranks 1…N-1:
    with proving_together():                  help_prove()
        ... verify.corruption(step_7) ──────▶     receives (step_7, digests, sizes), hashes its share
            hashes its share, gathers ◀──────      gathers
        ...                                       (waits for the next checkpoint, or the end)
    (leaving, even by an error) ────────────▶ returns

Every rank must be in the same place: rank 0 inside `proving_together` while the others are in `help_prove`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from megatron_ppo.checkpoint import verify
from megatron_ppo.parallel.collectives import broadcast_from_rank0


@contextlib.contextmanager
def proving_together() -> Iterator[None]:
    """On rank 0: inside, `verify.corruption` reads a share of each checkpoint's files and gathers the others'
    (`help_prove` on every other rank); leaving releases them."""
    token = verify.SHARED_READING.set(_read_shared)
    try:
        yield
    finally:
        verify.SHARED_READING.reset(token)
        broadcast_from_rank0(None)  # the end: `help_prove` returns


def help_prove() -> None:
    """On every rank but 0, while rank 0 is inside `proving_together`: read this rank's share of each checkpoint
    rank 0 asks about, until it is done."""
    while (asked := broadcast_from_rank0(None)) is not None:
        checkpoint, digests, sizes = asked
        with contextlib.suppress(OSError):  # rank 0 names it
            _share_read(Path(checkpoint), digests, sizes)


def _read_shared(checkpoint: Path, digests: dict[str, str], sizes: dict[str, int]) -> list[str]:
    broadcast_from_rank0((str(checkpoint), digests, sizes))
    return _share_read(checkpoint, digests, sizes)


def _share_read(checkpoint: Path, digests: dict[str, str], sizes: dict[str, int]) -> list[str]:
    """Hash this rank's share of `digests`' files; every rank's differing files (sorted), or the first `OSError`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = verify.shares({name: sizes.get(name, 0) for name in digests}, world)[rank]
    try:
        found: tuple[list[str], str | None] = (verify.differing(checkpoint, {n: digests[n] for n in mine}), None)
    except OSError as error:
        found = ([], str(error))
    everyone: list = [found] if world == 1 else [None] * world
    if world > 1:
        dist.all_gather_object(everyone, found)
    if errors := [error for _, error in everyone if error]:
        raise OSError(errors[0])
    return sorted(name for differ, _ in everyone for name in differ)
