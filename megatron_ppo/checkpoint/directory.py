"""A run's checkpoint directory: which `step_N` checkpoints it holds, which are complete, which run saved each,
the one `latest` names, and pruning.

A checkpoint is written to `<root>/.tmp_step_N`, published by renaming it to `<root>/step_N`, and only then named
in `<root>/latest` (itself replaced atomically, `point_latest_at`); the writing is `store.save_checkpoint`'s. A save
killed at any point therefore leaves the previous checkpoint as the newest complete one; `find_resumable` skips
anything incomplete with a warning. Complete means: the files a save writes last are there, and every file matches
the manifest the save wrote (`verify.py`); `damage` says why a checkpoint is not. One about to be loaded must also
prove its bytes (`unproven`: every file's digest read back), asked once, by one process: `find_resumable` and
`resolve` with `prove` at a run's start (rank 0) and by the export, the keeper's rollback target (rank 0). A step
saved again (after a rollback to it) replaces the old `step_N` by two renames, the old one kept as `.replaced_step_N`
until the new one is in place; `restore_replaced` undoes a save killed between the two.

A checkpoint is deleted in two steps: renamed to `.discarded_step_N.<id>` (`discard`, atomic), which nothing reads
as a checkpoint, then deleted (`delete_discarded`) — by an asynchronous save's next writer process or at the end,
so that the deleting does not stop training. A job killed between the two leaves a `.discarded_*` directory, never
a half-deleted `step_N`; the next save deletes it.

A checkpoint the trainer's guards judged good (its policy passed the next iteration's) holds `judged_good`, written
beside its files once it is published (not in its manifest: a judgment about the checkpoint, not part of it); a run
resumed from it knows it good at once (`train/checkpoint_keeper.py`). A step saved again is a new directory, unjudged.

A training run's checkpoints hold its identity (`run.json`, see `run_identity.py`). Resuming and rolling back
follow one run only, and pruning removes only that run's older checkpoints, never the one `latest` names (nor those
the caller protects: the trainer's good checkpoint, which a rollback loads, and its best evaluation's).
"""

from __future__ import annotations

import logging
import re
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from megatron.core import dist_checkpointing

from megatron_ppo.checkpoint import verify
from megatron_ppo.checkpoint.run_identity import RUN_FILE, RunIdentity, UnreadableIdentity

logger = logging.getLogger(__name__)
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
JUDGED_GOOD = "judged_good"
REPLACED_PREFIX = ".replaced_"
DISCARDED_PREFIX = ".discarded_"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def damage(path: Path) -> str | None:
    """Why `path` is not a complete checkpoint (None: it is): a file the save writes last is missing, or a file
    differs from the manifest written at save (`verify.py`)."""
    if not path.is_dir():
        return "it does not exist"
    if not (path / TRAINER_STATE).is_file():
        return f"it has no {TRAINER_STATE} (a save that did not finish)"
    try:
        megatron_metadata = dist_checkpointing.check_is_distributed_checkpoint(str(path))
    except (OSError, ValueError) as error:  # unreadable JSON (a decode error is a ValueError)
        return f"its Megatron checkpoint metadata is unreadable ({type(error).__name__}: {error})"
    if not megatron_metadata:
        return "it has no Megatron checkpoint metadata (a save that did not finish)"
    return verify.damage(path)


def is_complete(path: Path) -> bool:
    return damage(path) is None


def unproven(path: Path) -> str | None:
    """Why `path` is not to be loaded (None: it is complete and every file holds the bytes its save wrote): a file
    missing, of another size or whose digest differs from the manifest's (`verify.damage`, `verify.corruption`,
    which reads every file: asked first, so a damaged file is named before anything reads it), or `damage`."""
    if path.is_dir() and (why := verify.damage(path) or verify.corruption(path)):
        return why
    return damage(path)


def step_directories(root: Path) -> list[tuple[int, Path]]:
    """Every `step_N` directory under `root`, complete or not, as (N, path)."""
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    return [(step, path) for step, path in step_directories(root) if is_complete(path)]


def run_of(checkpoint: Path) -> str | None:
    """The id of the run that saved `checkpoint`; None for an initialisation or a checkpoint from before run ids."""
    identity = RunIdentity.read(checkpoint)
    return identity.run_id if identity else None


def named_by_latest(root: Path) -> Path | None:
    tracker = root / LATEST
    return root / tracker.read_text().strip() if tracker.is_file() else None


def find_resumable(root: str | Path, prove: bool = False) -> Path | None:
    """The checkpoint to continue: the one `latest` names when complete. Otherwise (with a warning) the newest
    complete checkpoint of the run `latest` named — or, without a readable `latest`, of the only run present; never
    another run's. None when there is nothing to continue (or several runs and nothing to choose between them).
    `prove`: complete means proving its bytes too (`unproven`: every file read back), which one process asks of the
    checkpoint it is about to have loaded (the run's start on rank 0), not every rank."""
    root = Path(root)
    named = named_by_latest(root)
    judge = unproven if prove else damage
    if named is not None and (why := judge(named)) is None:
        return named
    for partial in root.glob(".tmp_step_*") if root.is_dir() else []:
        logger.warning("ignoring %s: a save that did not finish", partial)
    complete = [(step, path) for step, path in complete_checkpoints(root) if path != named]
    if named is not None and (named_run := readable_run(named)) is not None:
        runs = {named_run}
        logger.warning("skipping %s, named by %s: %s; looking for an older one of its run", named, LATEST, why)
    else:
        runs = {readable_run(path) for _, path in complete}
        if named is not None and complete:
            logger.warning("checkpoint %s named by %s is missing; looking for an older one", named, LATEST)
        if len(runs) > 1:
            logger.warning("%s holds checkpoints of %d runs and no usable %s: not choosing", root, len(runs), LATEST)
            return None
    own = [path for _, path in complete if readable_run(path) in runs]
    for path in reversed(own):
        if not prove or (corrupt := verify.corruption(path)) is None:
            return path
        logger.warning("skipping %s: %s", path, corrupt)
    return None


def checked(path: Path) -> tuple[list[str], int]:
    """`unproven` asked of the checkpoint `path`, or of each `step_N` under it: a line for each, and how many cannot
    be trusted (`megatron-ppo verify-checkpoint`)."""
    checkpoints = [path] if not step_directories(path) else [checkpoint for _, checkpoint in step_directories(path)]
    lines, damaged = [], 0
    for checkpoint in checkpoints:
        started = time.perf_counter()
        why = unproven(checkpoint)
        files, size, digests = verify.recorded(checkpoint)
        if why is not None:
            damaged += 1
            lines.append(f"{checkpoint}: damaged: {why}")
        elif digests:
            lines.append(f"{checkpoint}: proves its bytes ({files} files, {size / 2**20:.1f} MiB read back in "
                         f"{time.perf_counter() - started:.1f} s)")  # fmt: skip
        else:
            lines.append(f"{checkpoint}: complete by its files' sizes (saved before digests were recorded)")
    return lines, damaged


def readable_run(checkpoint: Path) -> str | None:
    """The run that saved `checkpoint` when its identity is there and readable (None: an initialisation's, or damaged
    bytes); an identity that reads but names no run id is refused (`RunIdentity.read`)."""
    if not (checkpoint / RUN_FILE).is_file():
        return None
    try:
        return run_of(checkpoint)
    except UnreadableIdentity:
        return None


def resolve(path: str | Path, prove: bool = False) -> Path:
    """`path` if it is a complete checkpoint, else the newest complete one under it (a checkpoint root); a
    `CheckpointError` saying why otherwise (a damaged checkpoint: which files differ from its manifest). `prove`: as
    `find_resumable`'s (every file read back: one process, before it loads or exports the checkpoint)."""
    path = Path(path)
    why = (unproven if prove else damage)(path)
    if why is None:
        return path
    if (path / TRAINER_STATE).is_file() or (path / verify.MANIFEST).is_file():
        raise verify.CheckpointError(f"checkpoint {path} is damaged: {why}; use another checkpoint")
    found = find_resumable(path, prove)
    if found is None:
        raise verify.CheckpointError(f"{path} is neither a complete checkpoint nor a directory holding one ({why})")
    return found


def mark_judged_good(checkpoint: Path, step: int) -> bool:
    """Write `judged_good` into `checkpoint` (the guards of iteration `step` passed its policy); False while it is
    not published yet (an asynchronous save's write still running): ask again later."""
    if not checkpoint.is_dir():
        return False
    marker = checkpoint / f".{JUDGED_GOOD}.tmp"
    marker.write_text(f"judged good by the guards of step {step}\n")
    marker.replace(checkpoint / JUDGED_GOOD)
    return True


def judged_good(checkpoint: Path) -> bool:
    return (checkpoint / JUDGED_GOOD).is_file()


def point_latest_at(checkpoint: Path) -> None:
    """Name `checkpoint` (complete, directly under its root) in the root's `latest`, atomically."""
    tracker = checkpoint.parent / f".{LATEST}.tmp"
    tracker.write_text(checkpoint.name)
    tracker.replace(checkpoint.parent / LATEST)


def restore_replaced(root: Path) -> Path | None:
    """Put back the checkpoint `latest` names when a save that was replacing it was killed between its two renames
    (it is then `.replaced_step_N`, complete); returns it. Rank 0 only, before anything reads the directory."""
    named = named_by_latest(root)
    if named is None or named.exists() or not (root / f"{REPLACED_PREFIX}{named.name}").is_dir():
        return None
    (root / f"{REPLACED_PREFIX}{named.name}").rename(named)
    return named


def discard(path: Path) -> None:
    """Set `path` (a checkpoint, or a replaced one) aside for deletion under a name nothing reads as a checkpoint
    (`delete_discarded` deletes it); nothing when it does not exist."""
    if path.exists():
        path.rename(path.parent / f"{DISCARDED_PREFIX}{path.name}.{time.time_ns()}")


def delete_discarded(root: Path) -> None:
    """Delete what `discard` set aside under `root` (rank 0; not while a publication may be discarding)."""
    for path in root.glob(f"{DISCARDED_PREFIX}*") if root.is_dir() else []:
        shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, run_id: str, keep: int, step: int, protect: Sequence[Path] = ()) -> None:
    """Set aside for deletion (`discard`; `delete_discarded` deletes them) the complete checkpoints of run `run_id`
    beyond the `keep` newest of its current line of training.

    The line of training is the checkpoints up to `step`, newest first; a checkpoint past `step` (left by a branch
    the run abandoned when it resumed from an older one) counts as older than all of them. The checkpoint just
    saved ranks first, so the one `latest` names is never deleted; nor is another run's checkpoint, or an
    incomplete or damaged one (left for a person to inspect; it never counts among the `keep`, so it never
    becomes the only checkpoint left)."""
    own = [(s, path) for s, path in complete_checkpoints(root) if readable_run(path) == run_id]
    own.sort(key=lambda item: (item[0] <= step, item[0]), reverse=True)
    for _, path in own[keep:]:
        if any(path.resolve() == p.resolve() for p in protect):
            continue
        discard(path)
