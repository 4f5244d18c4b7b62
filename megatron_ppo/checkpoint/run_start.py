"""Starting a run in its directories: a new run or the one it continues, never mixed with another run.

- Which run. `trainer.resume_mode=auto` continues the run whose checkpoint `latest` names in
  `trainer.default_local_dir`; `resume_path` the run that saved `trainer.resume_from_path`; `disable` (or nothing to
  continue) starts a new run with a new id. The start says which, and a continued run lists the config keys that
  differ from its checkpoint's (`run_identity.config_differences`).
- No silent reuse. A run refuses (`ConfigError`: each process exits 2) to start in a `default_local_dir` holding
  checkpoints of another run; the message names the directory and the ways on. `trainer.overwrite=true` moves those
  checkpoints (with `latest` if it names one) aside into `<default_local_dir>/moved-aside/<UTC time>-<hex>/`;
  nothing is deleted.
- Logs. Each run writes its TensorBoard events into `<trainer.log_dir>/<run id>/` (the run's own folder, continued
  by every job that resumes it): two runs never share event files, TensorBoard shows them as separate runs, and
  `report` reads one run at a time and names it.

Rank 0 reads the directories, decides and moves files; every rank receives its decision.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ppo.checkpoint import directory, lock
from megatron_ppo.checkpoint.proof import help_prove, proving_together
from megatron_ppo.checkpoint.run_identity import RunIdentity, UnreadableIdentity, config_differences, new_run_id
from megatron_ppo.checkpoint.verify import CheckpointError
from megatron_ppo.config.errors import ConfigError, UserError
from megatron_ppo.config.schema import PPOConfig, TrainerConfig
from megatron_ppo.parallel.collectives import broadcast_from_rank0, global_rank

MOVED_ASIDE = "moved-aside"


@dataclass(frozen=True)
class RunStart:
    """What a starting run is: its identity (continued or new, with the current config), the checkpoint it continues
    from, its TensorBoard folder, and what the start did, as lines for the logs."""

    identity: RunIdentity
    resume_from: Path | None
    log_dir: Path
    messages: tuple[str, ...]
    # the checkpoint `latest` is to name once it has loaded (the run goes on from it: a restart before its next
    # save does too); None: `latest` names it already, or it lies outside the run's directory
    name_in_latest: Path | None = None


def start_run(config: PPOConfig) -> RunStart:
    """Decide on rank 0 which run this is and prepare `trainer.default_local_dir` for it (see the module docstring):
    its lock taken (`lock.py`), the checkpoint to continue verified (its bytes read by every rank, a share each:
    `proof.py`). A refusal (another run's checkpoints, a damaged
    `trainer.resume_from_path`, another job holding the directory) is raised on every rank: rank 0 raises its own
    `UserError`, the others a `UserError` with its message."""
    outcome: Any = None
    failure: Exception | None = None
    if global_rank() == 0:
        try:
            with proving_together():  # the checkpoint to continue read by every rank, a share each
                outcome = _start(config)
        except UserError as refusal:  # the other ranks are waiting for a decision: send them the refusal...
            failure, outcome = refusal, ("refused", str(refusal))
        except Exception as error:  # ... or the failure
            failure, outcome = error, ("failed", f"rank 0 could not prepare the run's directories: {error!r}")
    else:
        help_prove()
    outcome = broadcast_from_rank0(outcome)
    if failure is not None:
        raise failure
    if isinstance(outcome, tuple):
        kind, message = outcome
        raise UserError(message) if kind == "refused" else RuntimeError(message)
    return outcome


def _start(config: PPOConfig) -> RunStart:
    trainer = config.trainer
    root = Path(trainer.default_local_dir)
    messages = []
    if (taken_over := lock.acquire(root)) is not None:
        messages.append(taken_over)
    if (restored := directory.restore_replaced(root)) is not None:
        messages.append(f"restored {restored}, which a killed save was replacing")
    source, how = _resume_source(trainer, root)
    if source is None:
        identity = RunIdentity.of(new_run_id(), config)
        messages.append(f"new run {identity.run_id} (config {identity.config_hash})")
    else:
        saved = RunIdentity.read(source)
        identity = RunIdentity.of(saved.run_id, config)
        messages.append(f"resumed from {source} ({how}): run {saved.run_id} continues")
        expected, other = config_differences(saved.config, identity.config)
        if other:
            messages.append(
                f"the config differs from the one run {saved.run_id} saved in {source.name} (config "
                f"{saved.config_hash} → {identity.config_hash}) in {len(other)} key(s): "
                + "; ".join(other)
                + "; the run continues with the new values (optimizer settings and learning-rate schedules "
                "included, from the saved step on); for a new run with them: trainer.resume_mode=disable "
                "trainer.overwrite=true, or another trainer.default_local_dir"
            )
        if expected:
            messages.append("changed since the checkpoint (keys meant to change): " + "; ".join(expected))
    foreign = _other_runs_checkpoints(root, identity.run_id)
    if foreign and not trainer.overwrite:
        raise ConfigError([_refusal(root, foreign, trainer.resume_mode)])
    if foreign:
        messages.append(_move_aside(root, foreign))
    named = directory.named_by_latest(root)
    in_root = source is not None and source.parent.resolve() == root.resolve()
    name_in_latest = None
    if in_root and (named is None or named.resolve() != source.resolve()):
        name_in_latest = source  # moved by the trainer once the checkpoint has loaded, not before
        messages.append(f"{root / directory.LATEST} now names {source.name}, the checkpoint this run continues")
    return RunStart(identity, source, Path(trainer.log_dir) / identity.run_id, tuple(messages), name_in_latest)


def _resume_source(trainer: TrainerConfig, root: Path) -> tuple[Path | None, str]:
    """The checkpoint to continue and how it was chosen. `trainer.resume_from_path` naming one that holds no run
    identity is refused here; `auto` finding one continues nothing (the directory rule then refuses it)."""
    if trainer.resume_mode == "disable":
        return None, ""
    if trainer.resume_mode == "auto":
        source = directory.find_resumable(root, prove=True)
        if source is None or RunIdentity.read(source) is None:
            return None, ""
        named = directory.named_by_latest(root)
        if named == source:
            return source, f"named by {root / directory.LATEST}"
        why = directory.unproven(named) if named else None
        skipped = f"; skipped {named.name}, which {directory.LATEST} named: {why}" if named else ""
        return source, f"its newest complete checkpoint{skipped}"
    try:
        source = directory.resolve(trainer.resume_from_path, prove=True)
    except CheckpointError as unusable:
        raise ConfigError(
            [f"trainer.resume_from_path={trainer.resume_from_path!r}: {unusable}; nothing was changed (latest names "
             f"{_latest_name(root)}): resume from another checkpoint, or trainer.resume_mode=auto"]
        ) from None  # fmt: skip
    if RunIdentity.read(source) is None:
        raise ConfigError(
            [f"trainer.resume_from_path: {source} holds no run identity (an initialisation, or a checkpoint from "
             f"before run ids), so no run continues from it: start a new run from its weights with "
             f"model.init_checkpoint={source} trainer.resume_mode=disable"]
        )  # fmt: skip
    return source, "trainer.resume_from_path"


def _latest_name(root: Path) -> str:
    named = directory.named_by_latest(root)
    return "nothing" if named is None else named.name


def check_directories(config: PPOConfig) -> None:
    """Create `trainer.default_local_dir` and `trainer.log_dir` and write a file into each (on every process, before
    any process group or model: a directory that refuses writes fails now, not at the first save after hours of
    training); a `ConfigError` naming the key otherwise."""
    problems = []
    for key in ("default_local_dir", "log_dir"):
        folder = Path(getattr(config.trainer, key))
        probe = folder / f".write-test-{socket.gethostname()}-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_text("megatron-ppo checks that this directory is writable\n")
            probe.unlink()
        except OSError as error:
            problems.append(f"trainer.{key}={str(folder)!r} cannot be written ({error.strerror or error}: "
                            f"{error.filename or folder}); make it writable or choose another directory")  # fmt: skip
    if problems:
        raise ConfigError(problems)


def _other_runs_checkpoints(root: Path, run_id: str) -> list[Path]:
    """The `step_N` directories under `root` not saved by run `run_id`. An incomplete one without identity (a
    damaged save), or one whose identity is damaged bytes, is not counted: it is left for a person to
    inspect."""
    found = []
    for _, path in directory.step_directories(root):
        try:
            run = directory.run_of(path)
        except UnreadableIdentity:
            continue
        if run != run_id and (run is not None or directory.is_complete(path)):
            found.append(path)
    return found


def _refusal(root: Path, foreign: list[Path], resume_mode: str) -> str:
    by_run: dict[str, list[str]] = {}
    for path in foreign:
        owner = directory.run_of(path)
        by_run.setdefault(f"run {owner}" if owner else "saved without a run id", []).append(path.name)
    held = "; ".join(f"{run}: {', '.join(names)}" for run, names in by_run.items())
    choices = []
    if resume_mode != "auto":
        choices.append("trainer.resume_mode=auto to continue the run that latest names")
    choices.append("another trainer.default_local_dir for this run")
    overwrite = "trainer.overwrite=true"
    if resume_mode == "auto":
        overwrite = f"trainer.resume_mode=disable {overwrite}"
    choices.append(f"{overwrite} to move them aside into {root / MOVED_ASIDE}/<UTC time>-<hex>/ (nothing is deleted)")
    return (
        f"trainer.default_local_dir={str(root)!r} holds checkpoints of another run ({held}), which this run "
        f"(trainer.resume_mode={resume_mode}) would mix with its own. Choose one of:\n      " + "\n      ".join(choices)
    )


def _move_aside(root: Path, foreign: list[Path]) -> str:
    """Move other runs' checkpoints, `latest` when it names one of them (or nothing), and unfinished saves into a new
    dated folder."""
    destination = root / MOVED_ASIDE / new_run_id()
    destination.mkdir(parents=True)
    named = directory.named_by_latest(root)
    # `latest` first, so that it never names a checkpoint already moved
    entries = [root / directory.LATEST] if named is not None and (named in foreign or not named.exists()) else []
    entries += foreign
    entries += sorted([*root.glob(".tmp_step_*"), *root.glob(f"{directory.REPLACED_PREFIX}step_*")])
    for entry in entries:
        entry.rename(destination / entry.name)
    return f"trainer.overwrite=true: moved {', '.join(e.name for e in entries)} aside into {destination}"
