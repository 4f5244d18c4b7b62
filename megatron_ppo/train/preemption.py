"""Ending a job early without losing anything, for the next job to resume.

- Preemption: Slurm signals a job before its time limit (`#SBATCH --signal=USR1@120`) and on a preemption
  (SIGTERM), and SIGTERM is also what `scancel` sends. Every rank finishes its current iteration; the ranks agree
  that one of them was signalled, a checkpoint is saved, and the process exits with `PREEMPTED_EXIT`. Because
  `srun --kill-on-bad-exit` may kill the slower ranks once the first exits (turning 75 into 143), rank 0 also
  writes the file named by `$MEGATRON_PPO_PREEMPTED_MARKER`, after every rank has saved: that is what the batch
  script checks. The trainer cannot tell a cancel from a preemption; the batch script can (from the job's record
  at slurmctld) and requeues the job unless it was cancelled (`slurm/ppo.sbatch`).
- A preemption signal before the training loop (while the data, the task, the conversions or the models are being
  built, which can outlast the launcher's 30 s grace) stops at once: there is nothing new to save, so the process
  writes the marker and exits `PREEMPTED_EXIT` (`StoppedBeforeTraining`); the next job starts the set-up again.
- Job budget (`trainer.exit_interval`, `trainer.exit_duration_in_mins`): one job of a `--dependency=afterok` chain
  saves and exits 0; the next job resumes.
- Ctrl-C (SIGINT; torchrun forwards it to each of its processes once): in the training loop it ends as a preemption
  does — the iteration finished, a checkpoint saved — but with `INTERRUPTED_EXIT` and nothing requeued. Before the
  loop there is nothing to save, and a second Ctrl-C means "now": both raise `KeyboardInterrupt` at once.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

import psutil

from megatron_ppo.parallel.collectives import any_rank, global_rank
from megatron_ppo.startup import early_signals
from megatron_ppo.startup.early_signals import MARKER_ENV, PREEMPTED_EXIT, SIGNALS  # noqa: F401 — MARKER_ENV: said here too

INTERRUPTED_EXIT = 130  # 128 + SIGINT: what a shell reports for a Ctrl-C


class JobStopped(Exception):
    """Raised once the checkpoint of a run that stops early is saved; `exit_status` is what the CLI returns."""

    exit_status = 0


class Preempted(JobStopped):
    """A preemption, time-limit or cancel signal: exit `PREEMPTED_EXIT`; the batch script requeues the job unless
    Slurm cancelled it."""

    exit_status = PREEMPTED_EXIT


class StoppedBeforeTraining(Preempted):
    """A preemption signal before the training loop: nothing new to save; the marker written, exit
    `PREEMPTED_EXIT`. The message is the signal's name."""


class Interrupted(JobStopped):
    """Ctrl-C during the training loop: the checkpoint saved, exit `INTERRUPTED_EXIT`, not requeued."""

    exit_status = INTERRUPTED_EXIT


class JobBudgetReached(JobStopped):
    """`trainer.exit_interval` or `trainer.exit_duration_in_mins` reached: exit 0 so the next chained job starts."""


class PreemptionWatch:
    """Records a preemption signal or a Ctrl-C; `agreed()` is true on every rank once any rank got one. A Ctrl-C is
    deferred to the iteration's end only while `in_loop` (the trainer's loop sets it); a preemption signal once the
    loop has started (`loop_started`), and before it ends the process at once (`StoppedBeforeTraining`)."""

    def __init__(self, say: Callable[[int, str], object] = lambda status, text: print(text, file=sys.stderr)) -> None:
        self.say = say  # how a stop that cannot unwind says so: (exit status, text); the CLI's `tell_user`
        self.signalled: int | None = None
        self.interrupted = False
        self.in_loop = False
        self.loop_started = False
        self.ending: threading.Timer | None = None  # a stop before training: ends the process if it cannot unwind
        self._ending_lock = threading.Lock()
        self.restored = False
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        # the signals' numbers as the interpreter's C handler writes them, heard by a thread (`_hear`)
        self._heard, wakeups = socket.socketpair()
        wakeups.setblocking(False)
        self._wakeups = wakeups
        self._previous_wakeup_fd = signal.set_wakeup_fd(wakeups.fileno(), warn_on_full_buffer=False)
        threading.Thread(target=self._hear, name="preemption-watch", daemon=True).start()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signalled = signum
        if not self.loop_started:
            self._end_before_training(signum)
            raise StoppedBeforeTraining(signal.Signals(signum).name)

    def _end_before_training(self, signum: int) -> None:
        """A stop before training: the marker, and the timer that ends the process if its unwinding is stuck (once,
        whoever asks first: the handler, or `_hear`)."""
        with self._ending_lock:
            if self.ending is None and not self.restored:
                if not early_signals.stopped_by_plain_torchrun():  # a preemption, not torchrun ending the others
                    mark_preempted()
                self.ending = end_within(SET_UP_STOP_GRACE_S, signal.Signals(signum).name, self.say)

    def _hear(self) -> None:
        """The stop signals as they arrive, on a thread of their own: the Python handler runs on the main thread
        only between its bytecodes, and a main thread blocked in C++ — a store or collective wait for a peer that
        the same signal stopped — would never run it (the agent SIGKILLs it 30 s later: no line, no marker). Before
        training, the timer is started from here (`_end_before_training`)."""
        while True:
            try:
                heard = self._heard.recv(1)
            except OSError:
                return
            if not heard:
                return
            if heard[0] in SIGNALS and not self.loop_started:
                self._end_before_training(heard[0])

    def answer(self, signum: int) -> None:
        """A stop signal received before this watch was installed (`early_signals`), answered as if now."""
        self._handle(signum, None)

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        if not self.in_loop or self.interrupted:
            raise KeyboardInterrupt
        self.interrupted = True
        if global_rank() == 0:
            print("interrupt: finishing this iteration and saving a checkpoint (Ctrl-C again to stop at once)",
                  file=sys.stderr, flush=True)  # fmt: skip

    @contextmanager
    def in_the_loop(self) -> Iterator[None]:
        """The training loop: a Ctrl-C inside it is answered after the iteration, with a checkpoint."""
        self.in_loop = self.loop_started = True
        try:
            yield
        finally:
            self.in_loop = False

    def agreed(self) -> bool:
        return any_rank(self.signalled is not None or self.interrupted)

    def stop(self, checkpoint: str) -> JobStopped:
        """What an agreed stop raises once `checkpoint` is saved: `Interrupted` when any rank got a Ctrl-C (every
        rank reaches this together, after `agreed()`), else `Preempted`."""
        return Interrupted(checkpoint) if any_rank(self.interrupted) else Preempted(checkpoint)

    def restore(self) -> None:
        """The handlers as they were; a stop's unwinding has reached the end of the watch: its timer is off."""
        with self._ending_lock:
            if self.ending is not None:
                self.ending.cancel()
            self.restored = True  # nothing starts another
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(self._previous_wakeup_fd)
        self._wakeups.close()
        self._heard.shutdown(socket.SHUT_RDWR)
        self._heard.close()


# How long a stop before training may take to unwind (its `finally` blocks, the process groups' teardown) before the
# process says so and ends at once: a step of it may wait in a collective that another process, stopped by the same
# signal, never joins. The agent SIGKILLs 30 s after the signal, with no outcome and no marker.
SET_UP_STOP_GRACE_S = 3.0


def stopped_by_the_launcher(name: str) -> str:
    """What a worker of plain `torchrun` stopped by `name` before training says (`stopped_by_plain_torchrun`)."""
    return (f"stopped by {name} from the launcher before training (another rank failed first? its error is above, or "
            "in its log)")  # fmt: skip


def end_within(grace_s: float, name: str, say: Callable[[int, str], object]) -> threading.Timer:
    """A daemon timer (started, returned): this process, unless the timer is cancelled (the watch's end: the
    unwinding got out), says `grace_s` after a stop signal before training that it was stopped (`say`: exit status,
    text) and ends with `PREEMPTED_EXIT` at once (`os._exit`: the unwinding is stuck, and what is left of it is what
    the process's end does anyway — sockets closed, locks released)."""

    def end() -> None:
        stuck = (f"its set-up did not end within {grace_s:g} s of the signal (waiting for a process already stopped), "
                 "so it ended at once")  # fmt: skip
        if early_signals.stopped_by_plain_torchrun():
            status = 128 + signal.Signals[name].value
            say(status, f"{stopped_by_the_launcher(name)}: nothing new to save; {stuck}")
            os._exit(status)
        say(PREEMPTED_EXIT, f"stopped early by {name} before training: nothing new to save; {stuck}; exiting with "
                            f"{PREEMPTED_EXIT}, requeued unless it was cancelled")  # fmt: skip
        os._exit(PREEMPTED_EXIT)

    timer = threading.Timer(grace_s, end)
    timer.daemon = True
    timer.start()
    return timer


_active: list[PreemptionWatch] = []


@contextmanager
def watching(say: Callable[[int, str], object] | None = None) -> Iterator[PreemptionWatch]:
    """The watch already active (the CLI starts one before any model is built, so that a signal during set-up ends
    the job as a preemption — the marker, exit 75 — not by the signal's default action), or a new one for the
    duration of the block; `say`: how a stop that cannot unwind tells the user (the CLI's `tell_user`; else stderr)."""
    if _active:
        yield _active[-1]
        return
    watch = PreemptionWatch() if say is None else PreemptionWatch(say)
    _active.append(watch)
    try:
        if (early := early_signals.received()) is not None:  # came while the command was still importing
            watch.answer(early)
        yield watch
    finally:
        _active.pop()
        watch.restore()


class JobBudget:
    """This job's share of a chained run: stop after a step divisible by `exit_interval`, or once
    `exit_duration_in_mins` have passed since this process started (agreed across ranks: clocks differ)."""

    def __init__(self, exit_interval: int | None, exit_duration_in_mins: float | None) -> None:
        self.exit_interval = exit_interval
        started = psutil.Process().create_time()
        self.deadline = None if exit_duration_in_mins is None else started + 60 * exit_duration_in_mins

    def reason(self, step: int) -> str | None:
        if self.exit_interval and step % self.exit_interval == 0:
            return f"step {step} is a multiple of trainer.exit_interval={self.exit_interval}"
        if self.deadline is not None and any_rank(time.time() > self.deadline):
            return "trainer.exit_duration_in_mins has passed"
        return None


def mark_preempted() -> None:
    """Rank 0 writes `$MEGATRON_PPO_PREEMPTED_MARKER` (when set) for the batch script. Called after `save_checkpoint`,
    whose closing barrier means every rank has saved."""
    if global_rank() == 0:
        early_signals.write_marker()
