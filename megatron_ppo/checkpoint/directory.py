"""A run's checkpoint directory: which `step_N` checkpoints it holds, which are complete, which run saved each,
the one `latest` names, and pruning.

A checkpoint is written to `<root>/.tmp_step_N`, published by renaming it to `<root>/step_N`, and only then named
in `<root>/latest` (itself replaced atomically, `point_latest_at`); the writing is `store.save_checkpoint`'s. A save
killed at any point therefore leaves the previous checkpoint as the newest complete one; `find_resumable` skips
anything incomplete with a warning. Complete means: the files a save writes last are there, and every file matches
the manifest the save wrote (`verify.py`); `damage` says why a checkpoint is not. A step saved again (after a
rollback to it) replaces the old `step_N` by two renames, the old one kept as `.replaced_step_N` until the new one
is in place; `restore_replaced` undoes a save killed between the two.

A checkpoint is deleted in two steps: renamed to `.discarded_step_N.<id>` (`discard`, atomic), which nothing reads
as a checkpoint, then deleted (`delete_discarded`) — by an asynchronous save's next writer process or at the end,
so that the deleting does not stop training. A job killed between the two leaves a `.discarded_*` directory, never
a half-deleted `step_N`; the next save deletes it.

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
from megatron_ppo.checkpoint.run_identity import RUN_FILE, RunIdentity

logger = logging.getLogger(__name__)
LATEST = "latest"
TRAINER_STATE = "trainer_state.pt"
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
    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        return "it has no Megatron checkpoint metadata (a save that did not finish)"
    return verify.damage(path)


def is_complete(path: Path) -> bool:
    return damage(path) is None


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


def find_resumable(root: str | Path) -> Path | None:
    """The checkpoint to continue: the one `latest` names when complete. Otherwise (with a warning) the newest
    complete checkpoint of the run `latest` named — or, without a readable `latest`, of the only run present; never
    another run's. None when there is nothing to continue (or several runs and nothing to choose between them)."""
    root = Path(root)
    named = named_by_latest(root)
    if named is not None and (why := damage(named)) is None:
        return named
    for partial in root.glob(".tmp_step_*") if root.is_dir() else []:
        logger.warning("ignoring %s: a save that did not finish", partial)
    complete = complete_checkpoints(root)
    if named is not None and (named / RUN_FILE).is_file():
        runs = {run_of(named)}
        logger.warning("skipping %s, named by %s: %s; looking for an older one of its run", named, LATEST, why)
    else:
        runs = {run_of(path) for _, path in complete}
        if named is not None and complete:
            logger.warning("checkpoint %s named by %s is missing; looking for an older one", named, LATEST)
        if len(runs) > 1:
            logger.warning("%s holds checkpoints of %d runs and no usable %s: not choosing", root, len(runs), LATEST)
            return None
    own = [path for _, path in complete if run_of(path) in runs]
    return own[-1] if own else None


def resolve(path: str | Path) -> Path:
    """`path` if it is a complete checkpoint, else the newest complete one under it (a checkpoint root); a
    `CheckpointError` saying why otherwise (a damaged checkpoint: which files differ from its manifest)."""
    path = Path(path)
    why = damage(path)
    if why is None:
        return path
    if (path / TRAINER_STATE).is_file() or (path / verify.MANIFEST).is_file():
        raise verify.CheckpointError(f"checkpoint {path} is damaged: {why}; use another checkpoint")
    found = find_resumable(path)
    if found is None:
        raise verify.CheckpointError(f"{path} is neither a complete checkpoint nor a directory holding one ({why})")
    return found


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
    own = [(s, path) for s, path in complete_checkpoints(root) if run_of(path) == run_id]
    own.sort(key=lambda item: (item[0] <= step, item[0]), reverse=True)
    for _, path in own[keep:]:
        if any(path.resolve() == p.resolve() for p in protect):
            continue
        discard(path)
