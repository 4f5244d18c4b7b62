"""The run's saves and which of them may be trusted: the good-checkpoint bookkeeping of `PPOTrainer`.

A save after iteration N holds the policy that iteration N+1 starts from, and only N+1 measures all of it — its
experience KL, its losses and values, and the one optimizer step of N that N's own update KL could not see (its
last). So a save is *unconfirmed* until the next iteration's guards ask for no rollback or stop (`judge`); it is
then the *good* checkpoint, the one a rollback loads and a guard stop leaves for a resume. A rollback fired by N+1
therefore returns past the save at N, even when the fault came with N+1's own update: the guards cannot tell which
update a bad iteration inherited, and one more save interval of work is the price of never reloading a blown-up
policy (`docs/design.md`, "Good checkpoints"). Beside it the keeper holds the best evaluation's checkpoint, which an
evaluation-drop rollback returns to.

With `trainer.async_save`, a save's shards are written in the background (`checkpoint/async_save.py`) and the
checkpoint is published later: at an iteration's end that finds every rank's write complete (`poll`), or when the
keeper has to read the directory or save again — the next save, a rollback, a stop, a resume — which first wait
for it (`wait`). Each save's cost (`SaveTiming`: how long training was blocked, how long the write took) goes to
`report`.

The keeper's own state (`state_dict`: the good and the best checkpoint as of a save) travels in the trainer state
of every checkpoint, under the keys checkpoints have always had. A judgment made after the last save would be lost
with the process: so a save judged good is also marked in its directory (`directory.mark_judged_good`, rank 0, once
it is published), and a run resumed from a marked checkpoint holds it as its good one — a rollback at the first
iteration after the resume returns to it, not to an older one (or nowhere) as the trainer state of its own save says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_ppo.checkpoint import directory, store
from megatron_ppo.checkpoint.async_save import AsyncSaves, SaveTiming
from megatron_ppo.checkpoint.proof import help_prove, proving_together
from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.config.schema import TrainerConfig
from megatron_ppo.models.gpt import RoleModel, sync_parameters
from megatron_ppo.parallel.collectives import (
    any_and_every_rank_within,
    barrier,
    broadcast_from_rank0,
    global_rank,
    host_group,
)
from megatron_ppo.train.guards import GuardAction

logger = logging.getLogger(__name__)
CLOSE_AGREEMENT_S = 30.0  # how long `close` waits for every rank to agree to publish a pending save


@dataclass(frozen=True)
class Rollback:
    """Where a rollback returns (`path`; None: nowhere yet) and why that checkpoint, for the log."""

    path: Path | None
    why: str


class CheckpointKeeper:
    """Saves the run's checkpoints and knows which are good: the last save (`saved`), the one the next iteration's
    guards have not judged yet (`unconfirmed`), the newest whose policy passed them (`good`), and the best
    evaluation's (`best`)."""

    def __init__(
        self, trainer: TrainerConfig, run: RunIdentity, report: Callable[[SaveTiming], None] | None = None
    ) -> None:
        self.root, self.keep, self.run, self.report = trainer.default_local_dir, trainer.max_ckpt_to_keep, run, report
        self.saves = AsyncSaves(report) if trainer.async_save else None
        # on a host group of its own, the agreement at `close` gives up after CLOSE_AGREEMENT_S (collective)
        self.group = host_group(CLOSE_AGREEMENT_S) if trainer.async_save else None
        self.plans = store.SavePlans()  # Megatron's save strategy, kept while what is saved keeps its structure
        self.saved: tuple[int, Path] | None = None  # (step, path) of the last save
        self.good: str | None = None  # the newest save whose policy passed the next iteration's guards
        self.unconfirmed: str | None = None  # a save the next iteration's guards have not judged yet
        self.best: str | None = None  # the checkpoint of the best evaluation (evaluation-drop rollbacks)
        self.to_mark: tuple[Path, int] | None = None  # judged good, not marked yet (rank 0: not published yet)

    # --- state ---------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best_checkpoint": self.best, "good_checkpoint": self.good}  # the good one as of this save

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The good and best checkpoints as of the save, in this run's directory: the state holds the paths the run
        had then, and a run directory moved or copied since (another file system, a backup restored) must not roll
        back into the old place — every checkpoint is `<root>/step_N`."""
        self.best = self._here(state["best_checkpoint"])
        self.good = self._here(state.get("good_checkpoint"))  # (absent in checkpoints saved before it was kept)

    def _here(self, checkpoint: str | None) -> str | None:
        return None if checkpoint is None else str(Path(self.root) / Path(checkpoint).name)

    # --- saving and loading --------------------------------------------------------------------------------------
    def save(
        self, step: int, models: dict[str, RoleModel], optimizers: dict[str, Any], trainer_state: dict[str, Any]
    ) -> tuple[Path, bool]:
        """Save at `step` (once per step: a new best evaluation, then `save_freq`, write one checkpoint); returns its
        path and whether it was written now. Pruning spares the good and the best checkpoint."""
        if self.saved is not None and self.saved[0] == step:
            return self.saved[1], False
        started = time.perf_counter()
        waited = self.wait()  # one pending save at most: the previous one is published first
        for model in models.values():
            sync_parameters(model)  # a distributed-optimizer step may still be gathering weights (CUDA overlap)
        path = store.save_checkpoint(
            self.root, step, models, optimizers, trainer_state, run=self.run, keep=self.keep,
            protect=lambda: [p for p in (self.best, self.good) if p], saves=self.saves, plans=self.plans,
        )  # fmt: skip
        blocked = time.perf_counter() - started - (waited.waited_s if waited else 0.0)
        if self.saves is not None:
            self.saves.returned(blocked)
        elif self.report is not None:
            self.report(SaveTiming(step, path, False, blocked_s=blocked, write_s=blocked))
        self.saved, self.unconfirmed = (step, path), str(path)
        return path, True

    def poll(self) -> None:
        """At an iteration's end: publish the pending save if every rank's write is done (collective)."""
        if self.saves is not None:
            self.saves.poll()
        self._mark()

    def wait(self) -> SaveTiming | None:
        """Publish the pending save, waiting for its write (collective); before anything reads the directory."""
        waited = self.saves.wait() if self.saves is not None else None
        self._mark()
        return waited

    def _mark(self) -> None:
        """Mark the save judged good in its directory once it is published (rank 0)."""
        if self.to_mark is not None and (global_rank() != 0 or directory.mark_judged_good(*self.to_mark)):
            self.to_mark = None

    def close(self) -> None:
        """At the trainer's close, after `fit` (whose end published every save) or an exception out of it: a save
        still pending is published when every rank has one and they all arrive here within `CLOSE_AGREEMENT_S` (an
        exception every rank raised together); else it is left unpublished — `latest` names the previous
        checkpoint, as after a kill — rather than waited for in a collective that the other ranks, stopped
        elsewhere, may never join. Then the checkpoints the publications set aside (pruned, replaced) are deleted:
        an asynchronous save leaves that to the next save's writer, and there is none."""
        if self.saves is None:
            return
        if self.saves.pending is not None and any_and_every_rank_within(True, self.group) == (True, True):
            self.wait()
        if global_rank() == 0:
            directory.delete_discarded(Path(self.root))

    def resume(self, path: Path, models: dict[str, RoleModel], optimizers: dict[str, Any]) -> dict[str, Any]:
        """Load the checkpoint a run continues from; the next iteration judges it, as if saved just now. Returns
        the trainer state saved with it."""
        self.wait()
        state = store.load_checkpoint(path, models, optimizers)
        self.load_state_dict(state)
        if broadcast_from_rank0(directory.judged_good(path) if global_rank() == 0 else None):
            self.good, self.unconfirmed = str(path), None  # judged by the run that saved it
        else:
            self.unconfirmed = str(path)
        return state

    # --- judging -------------------------------------------------------------------------------------------------
    def judge(self, step: int, actions: Sequence[GuardAction]) -> None:
        """The unconfirmed save held the policy iteration `step` started from: good when its guards asked for no
        rollback or stop (and marked so in its directory), else passed over for good (a rollback has already loaded
        the good one)."""
        if self.unconfirmed is not None and not any(a.kind in ("rollback", "stop") for a in actions):
            self.good = self.unconfirmed
            self.to_mark = (Path(self.good), step)
            self._mark()
        self.unconfirmed = None

    def good_checkpoint(self) -> Path | None:
        """The good checkpoint while it can be loaded (`loadable`); a collective."""
        return self.loadable(self.good, "the good checkpoint")

    def loadable(self, checkpoint: str | None, what: str) -> Path | None:
        """`checkpoint` while it proves its bytes on disk (`directory.unproven`, judged on rank 0, every rank reading
        a share of its files: `proof.py`) and is this run's (another run may reuse its step's name); else None, with
        a warning naming `what` and why. A collective."""
        path = None if checkpoint is None else Path(checkpoint)
        why = None
        if path is not None and global_rank() != 0:
            help_prove()
        elif path is not None:
            with proving_together():  # its bytes read by every rank, a share each
                why = directory.unproven(path)
            if why is None and directory.run_of(path) != self.run.run_id:
                why = "another run's checkpoint has taken its name"
            if why is not None:
                logger.warning("%s %s cannot be loaded: %s", what, path, why)
        return path if broadcast_from_rank0(why) is None else None

    # --- rollback and stop ---------------------------------------------------------------------------------------
    def rollback_target(self, target: Literal["latest", "best_eval"]) -> Rollback:
        """The checkpoint a rollback to `target` loads: the best evaluation's, or the newest good one (a pending
        save is published first: it may be either)."""
        self.wait()
        if target == "best_eval":
            return Rollback(self.loadable(self.best, "the best evaluation's checkpoint"),
                            "the best evaluation's checkpoint")  # fmt: skip
        why = "the newest good checkpoint: its policy passed the guards of the iteration after it"
        if self.unconfirmed is not None:
            why += f"; {self.unconfirmed}, saved before this iteration, is passed over"
        return Rollback(self.good_checkpoint(), why)

    def roll_back_to(
        self, path: Path, models: dict[str, RoleModel], optimizers: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """Load `path` into the models and optimizers; it is then the last save and the good one, and `latest`
        names it (a resume after a crash continues from here, not from a passed-over save). Returns the trainer
        state saved with it, and whether the best evaluation was forgotten: it was the unconfirmed save's, passed
        over with it, so the best is the loaded checkpoint's."""
        self.wait()
        best, passed = self.best, self.unconfirmed
        state = store.load_checkpoint(path, models, optimizers)
        self.load_state_dict(state)
        self.saved, self.good, self.unconfirmed = (state["step"], path), str(path), None
        self.name_in_latest(path)
        forgotten = passed is not None and best == passed
        if not forgotten:
            self.best = best
        return state, forgotten

    def leave_for_stop(self) -> str:
        """Before a guard's stop: `latest` names the good checkpoint (a resume continues from it, not from a save
        the guards did not pass). Returns what the stop leaves, for its message."""
        self.wait()
        good = self.good_checkpoint()
        if good is None:
            return "no good checkpoint was saved: a new launch starts over"
        self.name_in_latest(good)
        return f"the good checkpoint left is {good} (`latest` names it: a new launch resumes from it)"

    @staticmethod
    def name_in_latest(path: Path) -> None:
        if global_rank() == 0:
            directory.point_latest_at(path)
        barrier()
