"""Whether a checkpoint's files are all there and hold the bytes its save wrote: a manifest written at save,
checked before a checkpoint is trusted.

Every rank records the xxh3-64 digest of each file it wrote (`write_digests`, into `digests_rank<r>.json`): its
shards, hashed by its asynchronous writer process once they are written (so training does not wait for it), its RNG
states, and on rank 0 the trainer state and run identity. `save_checkpoint` then writes `manifest.json` into the
checkpoint last, once every rank has written its files: each file under the checkpoint (relative path) with its size
in bytes and its digest (rank 0 hashes the files no rank did: Megatron's metadata, written at finalisation, and a
synchronous save's shards).

Two checks read it. `damage(path)` compares sizes: a file missing or of another size (a truncated copy, a disk that
filled up, a file removed by hand) makes the checkpoint damaged, with the first differences named; resuming,
rollbacks, pruning and export all go through `directory.is_complete`, which asks this. `corruption(path)` reads every
file and compares its digest (a shard overwritten in place, bit rot, a bad copy between filesystems keep the size):
asked once of a checkpoint about to be loaded (`directory.unproven`: the one a run resumes from and the one a
rollback returns to, decided on rank 0 with every rank of the job reading a share of the bytes — `proof.py`; the one
exported, by its one process). A checkpoint saved before manifests existed
is judged by its files alone (the older rule), one saved before digests by its sizes. Reading a checkpoint's files
that still fails (`reading`) ends in a `CheckpointError` naming it, not in the unpickler's or Megatron's internal error.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import xxhash

from megatron_ppo.config.errors import UserError

MANIFEST = "manifest.json"
DIGESTS = "digests_rank{rank}.json"  # one rank's files, hashed where it wrote them
_SHOWN = 3  # differences named in a message
_READ_BYTES = 16 * 2**20  # a file is hashed this much at a time
_HASHING_THREADS = 8  # files hashed at once (xxhash releases the GIL; reading is the bound)


class CheckpointError(UserError):
    """A checkpoint that cannot be used: damaged, incomplete, another run's or another model's; the message names
    it and what to do."""


def file_digest(path: Path) -> str:
    """The xxh3-64 digest of the file at `path`, as 16 hex digits."""
    digest, buffer = xxhash.xxh3_64(), bytearray(_READ_BYTES)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as file:
        while read := file.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def write_digests(checkpoint: Path, files: Iterable[Path], rank: int) -> None:
    """Record the size and digest of each of `files` (under `checkpoint`, written by `rank`) in its digests file."""
    entries = {str(path.relative_to(checkpoint)): [path.stat().st_size, file_digest(path)] for path in files}
    _write_json(checkpoint / DIGESTS.format(rank=rank), entries)


def write_manifest(checkpoint: Path) -> None:
    """Record every file under `checkpoint` with its size and digest (rank 0, after every rank has written its
    files): the digests the ranks recorded for a file still of the size they saw, the others computed here."""
    files = {
        str(path.relative_to(checkpoint)): path.stat().st_size
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and path.name != MANIFEST
    }
    recorded: dict[str, str] = {}
    for digests in checkpoint.glob(DIGESTS.format(rank="*")):
        for name, (size, digest) in json.loads(digests.read_text()).items():
            if files.get(name) == size:
                recorded[name] = digest
    missing = [name for name in files if name not in recorded]
    recorded.update(zip(missing, _hashed(checkpoint, missing), strict=True))
    _write_json(checkpoint / MANIFEST, {"files": files, "xxh3_64": {name: recorded[name] for name in files}})


def _write_json(path: Path, content: dict) -> None:
    """`content` into `path` whole or not at all (written beside it, then renamed)."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(content, indent=0, sort_keys=True) + "\n")
    temporary.replace(path)


def _hashed(checkpoint: Path, names: list[str]) -> list[str]:
    with ThreadPoolExecutor(_HASHING_THREADS) as pool:
        return list(pool.map(file_digest, [checkpoint / name for name in names]))


def recorded(checkpoint: Path) -> tuple[int, int, bool]:
    """What `checkpoint`'s manifest records: (files, bytes, whether with digests); (0, 0, False) without one."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        return len(manifest["files"]), sum(manifest["files"].values()), bool(manifest.get("xxh3_64"))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0, 0, False


def corruption(checkpoint: Path) -> str | None:
    """Which of `checkpoint`'s files hold other bytes than the digest its save recorded (None: none do, or its save
    recorded no digests). Reads every file — here, or a share on each rank of the job inside `checkpoint/proof.py`'s
    `proving_together`: asked of a checkpoint about to be loaded, after `damage`."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        digests, sizes = manifest.get("xxh3_64", {}), manifest["files"]
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        return None  # `damage` names an unreadable manifest
    try:
        shared = SHARED_READING.get()
        differ = differing(checkpoint, digests) if shared is None else shared(checkpoint, digests, sizes)
    except OSError as error:
        return f"a file cannot be read ({error})"
    if not differ:
        return None
    more = f" and {len(differ) - _SHOWN} more" if len(differ) > _SHOWN else ""
    return (
        f"{len(differ)} of its {len(digests)} files hold other bytes than when saved (their xxh3-64 digest differs "
        f"from {MANIFEST}; same size: overwritten in place, or damaged on disk or in a copy): "
        + ", ".join(differ[:_SHOWN])
        + more
    )


def differing(checkpoint: Path, digests: dict[str, str]) -> list[str]:
    """The files of `digests` (name → recorded digest) under `checkpoint` whose bytes hash otherwise, sorted; an
    `OSError` when one cannot be read."""
    names = sorted(digests)
    found = _hashed(checkpoint, names)
    return [name for name, digest in zip(names, found, strict=True) if digest != digests[name]]


def shares(sizes: dict[str, int], parts: int) -> list[list[str]]:
    """The files (name → bytes) in `parts` shares of about equal bytes — each, largest first, to the lightest share
    (ties: the lowest-numbered) — the same on every rank; each share sorted."""
    loads, out = [0] * parts, [[] for _ in range(parts)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = loads.index(min(loads))
        loads[lightest] += sizes[name]
        out[lightest].append(name)
    return [sorted(share) for share in out]


# How `corruption` reads a checkpoint's files: unset, all here (`differing`); inside `proof.proving_together`, a share
# on each rank of the job, weighed by the files' sizes (name → bytes).
SHARED_READING: ContextVar[Callable[[Path, dict[str, str], dict[str, int]], list[str]] | None] = ContextVar(
    "SHARED_READING", default=None
)


def damage(checkpoint: Path) -> str | None:
    """Why `checkpoint` does not match its manifest (None: it does, or it has none)."""
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"its {MANIFEST} is unreadable ({error})"
    problems = []
    for name, size in files.items():
        path = checkpoint / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{name} is {path.stat().st_size} bytes, {size} when saved")
    if not problems:
        return None
    more = f" and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
    return f"{len(problems)} of its {len(files)} files differ from {MANIFEST}: " + "; ".join(problems[:_SHOWN]) + more


@contextmanager
def reading(checkpoint: Path, what: str) -> Iterator[None]:
    """Turn a failure to read `checkpoint`'s files (truncated pickles, a zip archive torch cannot open, Megatron's
    metadata missing, a shard torch's reader fails on: its `CheckpointException`, which derives from
    `BaseException`, with the first failing rank's error) into a `CheckpointError` naming the checkpoint and `what`
    was being read."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (EOFError, pickle.UnpicklingError, AssertionError, RuntimeError, OSError, ValueError,
            CheckpointException) as caught:  # fmt: skip
        if isinstance(caught, UserError):
            raise
        error = next(iter(caught.failures.values()))[0] if isinstance(caught, CheckpointException) else caught
        first_line = next(iter(str(error).splitlines()), "")
        raise CheckpointError(
            f"{checkpoint} cannot be read ({what}: {type(error).__name__}: {first_line}): "
            "it is damaged or not a megatron-ppo checkpoint; resume from another one (trainer.resume_mode=resume_path "
            "trainer.resume_from_path=<an older step_N>) or delete it"
        ) from error


@contextmanager
def writing(temporary: Path, step: int) -> Iterator[None]:
    """Writing a checkpoint into `temporary`. A write the filesystem refuses (a full disk above all, which torch
    reports as `unexpected pos` or a checkpoint exception without the errno; a read-only or vanished directory), or
    that Megatron's writer processes report failed (on any rank: Megatron's finalisation raises on every rank),
    removes the partial save and ends in a `CheckpointError` saying so, with the space left and the checkpoint
    `latest` still names. Other failures are not the user's: they propagate as they are."""
    try:
        yield
    except BaseException as error:  # torch's CheckpointException derives from BaseException
        message = _write_failure(error, temporary, step)
        if message is None:
            raise
        shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(message) from error


@contextmanager
def writing_on_every_rank(temporary: Path, step: int) -> Iterator[None]:
    """`writing`, with the outcome agreed by every rank (a flag all-reduce; an object all-gather when some rank
    failed, `first_failure`): files
    written by some ranks only (rank 0's trainer state, manifest, renames) may fail on one rank, and the others
    must not wait for it in their next collective. The first failing rank's failure decides: the user's (`writing`)
    is the same `CheckpointError` on every rank, the partial save removed; a bug is its own traceback on the rank it
    happened on and a `RuntimeError` naming that rank on the others."""
    from megatron_ppo.parallel.collectives import first_failure

    failure: BaseException | None = None
    try:
        yield
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        failure = error
    message = None if failure is None else _write_failure(failure, temporary, step)
    first = first_failure(None if failure is None else (message is not None, message or repr(failure)))
    if first is None:
        return
    rank, (users, why) = first
    if users:
        shutil.rmtree(temporary, ignore_errors=True)
        raise CheckpointError(why) from failure
    if failure is not None and message is None:
        raise failure
    raise RuntimeError(f"rank {rank} failed while writing the checkpoint of step {step} ({why}): see its traceback")


def _write_failure(error: BaseException, temporary: Path, step: int) -> str | None:
    """The user's message for `error`, raised while writing `temporary`; None when it is not the user's."""
    if isinstance(error, CheckpointError):
        return str(error)
    root = temporary.parent
    free = shutil.disk_usage(root).free if root.is_dir() else 0
    code = _errno_in(error)
    full = code in (errno.ENOSPC, errno.EDQUOT) or free < _FULL_BELOW_BYTES
    writers = _writer_failures(error)
    if isinstance(error, KeyboardInterrupt | SystemExit) or not (full or code is not None or writers is not None):
        return None
    latest = root / "latest"
    kept = f"{latest} still names {latest.read_text().strip()}" if latest.is_file() else "no earlier checkpoint"
    cause = "the disk is full" if full else os.strerror(code) if code is not None else f"its writer failed: {writers}"
    fix = ("free space there, or point trainer.default_local_dir at a larger disk, and resume" if full
           else "make trainer.default_local_dir writable, and resume" if code is not None
           else "check that trainer.default_local_dir is writable, with space to spare, and resume")  # fmt: skip
    return (
        f"the checkpoint of step {step} could not be written to {root} ({cause}; {free / 2**20:.1f} MiB free): "
        f"the partial save was removed and {kept}; {fix}"
    )


def _writer_failures(error: BaseException) -> str | None:
    """What Megatron's checkpoint writers reported failed (torch's `CheckpointException`, which Megatron's
    finalisation raises on every rank once any rank's writer failed; the ranks' errors are on rank 0, the
    coordinator, alone): None for any other error."""
    from torch.distributed.checkpoint.api import CheckpointException

    if not isinstance(error, CheckpointException) or error.args[:1] != ("write",):
        return None
    shown = [f"rank {rank}: {failure[0] if isinstance(failure, tuple) else failure}"
             for rank, failure in sorted(error.failures.items())]  # fmt: skip
    return "; ".join(shown) if shown else "reported by the coordinator, rank 0"


_FULL_BELOW_BYTES = 16 * 2**20  # a failed write with less free than this: the disk filled up


def _errno_in(error: BaseException | None) -> int | None:
    """The errno of `error` or of an error it was raised from."""
    while error is not None:
        if isinstance(error, OSError) and error.errno:
            return error.errno
        error = error.__cause__ or error.__context__
    return None
