"""Checkpoint writes that do not stop training: Megatron-Core's asynchronous `dist_checkpointing` save, driven the
way Megatron-LM's `--async-save` drives it (`schedule_async_save`, `maybe_finalize_async_save`).

A save (`store.save_checkpoint(..., saves=...)`) builds the sharded state dicts, plans its shards (through the save
strategy the keeper keeps across saves of one structure, `store.SavePlans`: validated and exchanged between the
ranks once per structure, reused after), and hands them to Megatron's `AsyncCallsQueue`: each rank forks a writer
process (`TemporalAsyncCaller`; on CUDA the shards are first copied to host memory, on the CPU the fork's
copy-on-write pages are the snapshot), which writes the small files (`trainer_state.pt`, the RNG states, `run.json`)
into `.tmp_step_N` and then the shards, and training goes on. `poll()`, at each iteration's end, asks every rank at
once (one integer all-reduce) whether all writers have exited; once they have, the finalisation runs on every rank:
Megatron's (the global metadata, `metadata.json`), then the save's own (`.tmp_step_N` → `step_N`, `latest`, pruning,
which only renames: the next save's writer deletes). `wait()` finalises the pending save, blocking until its writers
are done: the trainer calls it before a rollback, the next save, a preemption or job-budget exit, a guard stop and
the end. A write that fails in any rank's writer is raised by Megatron's finalisation on every rank, and ends here
in one `CheckpointError` on every rank (`verify.writing`). Nothing is named in `latest` before its finalisation, so
a job killed mid-write resumes from the previous finalised checkpoint (`directory.find_resumable` skips
`.tmp_step_N`), and pruning, which reads only complete `step_N` directories, never sees a pending one.

Why Megatron's own writer (`async_strategy="mcore"`), not NVIDIA Resiliency Extension's (`nvrx`, which
megatron-core 0.19 recommends): 0.16.1, the oldest release admitted, has no `async_strategy` and no NVRx path,
and NVRx is a further package (CUDA-only persistent workers) that no CPU run or test could exercise; the mcore
writer is in every release admitted and runs on CPU processes (gloo) as it does on GPUs. Why a writer forked per
save, not Megatron's persistent one (`AsyncCallsQueue(persistent=True)`, which would save the fork, ~15–65 ms at
the tiny recipe): its worker starts with `torch.cuda.set_device(rank % torch.cuda.device_count())` (0.16.1 and
0.19: no CPU process survives it), and it receives the shards through a queue, so on the CPU, with nothing copied
to host memory first, it would write the live tensors while training changes them; the fork is the CPU snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

from megatron_ppo.checkpoint import verify


@dataclass(frozen=True)
class SaveTiming:
    """How long a save cost: `blocked_s`, training stopped for it (the sharded state dicts and Megatron's plan,
    the fork; for a synchronous save, all of it, plus `waited_s`); `write_s`, from its start until its checkpoint
    was published (the write seen complete at an iteration's end, or at a wait); `waited_s`, how long a `wait()`
    blocked training for the write to finish and the finalisation (0 when an iteration's end found it done);
    `finalised_s`, how long the finalisation at an iteration's end stopped training (Megatron's write-results
    gather and metadata, the manifest, the renames; 0 when a `wait()` finalised it, counted in `waited_s`)."""

    step: int
    path: Path
    asynchronous: bool
    blocked_s: float
    write_s: float
    waited_s: float = 0.0
    finalised_s: float = 0.0


@dataclass
class _Pending:
    step: int
    path: Path
    started: float  # time.perf_counter() when the save began
    blocked_s: float = 0.0


class AsyncSaves:
    """The run's one pending asynchronous save at most, and its finalisation; `report` receives each finished
    save's timing (on every rank)."""

    def __init__(self, report: Callable[[SaveTiming], None] | None = None) -> None:
        self.queue = AsyncCallsQueue(persistent=False)
        self.pending: _Pending | None = None
        self.report = report

    def schedule(self, request: Any, step: int, path: Path, started: float) -> None:
        """Start `request`'s write (collective: every rank schedules its own), `path` its published name. The
        previous save must be finalised first (`wait`): one pending save at most, so that a finalisation never
        prunes or renames under another's write."""
        if self.pending is not None:
            raise RuntimeError(f"a save of step {self.pending.step} is pending: wait() for it before saving again")
        self.queue.schedule_async_request(request)
        self.pending = _Pending(step, path, started)

    def returned(self, blocked_s: float) -> None:
        """The pending save returned to training after `blocked_s`."""
        if self.pending is not None:
            self.pending.blocked_s = blocked_s

    def poll(self) -> SaveTiming | None:
        """Finalise the pending save if every rank's write is complete (collective, does not wait)."""
        if self.pending is None:
            return None
        started = time.perf_counter()
        if not self._finalise(blocking=False):
            return None
        return self._finalised(waited_s=0.0, finalised_s=time.perf_counter() - started)

    def wait(self) -> SaveTiming | None:
        """Finalise the pending save, waiting for its writes (collective); None when nothing was pending."""
        if self.pending is None:
            return None
        started = time.perf_counter()
        self._finalise(blocking=True)
        return self._finalised(waited_s=time.perf_counter() - started)

    def _finalise(self, blocking: bool) -> bool:
        """Megatron's finalisation of the pending save, then the save's own, if its writers are done. A write that
        failed in a writer process (a full disk above all) is reported as a synchronous save's is
        (`verify.writing`: the partial save removed, one `CheckpointError`), and nothing is pending any more."""
        pending = self.pending
        assert pending is not None
        with verify.writing(pending.path.parent / f".tmp_{pending.path.name}", pending.step):
            try:
                return self.queue.maybe_finalize_async_calls(blocking=blocking)
            except BaseException:
                self.pending = None
                raise

    def _finalised(self, waited_s: float, finalised_s: float = 0.0) -> SaveTiming:
        pending, self.pending = self.pending, None
        assert pending is not None
        timing = SaveTiming(pending.step, pending.path, True, pending.blocked_s,
                            time.perf_counter() - pending.started, waited_s, finalised_s)  # fmt: skip
        if self.report is not None:
            self.report(timing)
        return timing
