"""`megatron-ppo train --nproc N`: N workers on this machine, started by torch's elastic agent (the engine of
`torchrun --standalone`), and what they decided said once at the shell with their exit status.

Plain `torchrun` answers any worker's non-zero exit with its own `ChildFailedError` page and exit 1, SIGTERMs the
other workers (a worker that had not yet printed its `error:` line never does), and ends a Ctrl-C with a
`SignalException` traceback. This launcher, instead:

1. composes and validates the config for N processes before it starts any (a layout N processes cannot run is one
   `error:` block and exit 2, with nothing started);
2. starts the workers with `$MEGATRON_PPO_OUTCOME_DIR` set: each worker writes what it has to tell the user (its
   exit status and its lines: an `error:` block, "interrupted: saved …", "stopped: …", a bug's traceback) to
   `rank<R>.json` there (`tell_user`), instead of printing it;
3. when the workers have ended, prints one outcome and exits with its status (`conclude`): a rank that died of a
   signal no one here sent (SIGKILL, SIGSEGV, …) first, since the others' errors follow from it; otherwise the
   outcome of the lowest rank with a non-zero status (the rank that decided, whichever it is), else rank 0's
   (a job budget's "stopped early" line, exit 0); a worker that exited non-zero without an outcome is named with
   its status; where the launcher received no signal, a worker's "stopped by SIGTERM" (the agent's, sent once
   another failed) never speaks before another's outcome. A signal to the launcher (Ctrl-C, Slurm's SIGTERM) is
   forwarded once to each worker by the agent,
   which waits for them (30 s, then SIGKILL): the workers' outcome (130 after a Ctrl-C, 75 after a preemption) is
   the launcher's exit.

Plain `torchrun` keeps working: without `$MEGATRON_PPO_OUTCOME_DIR`, rank 0 prints the outcome itself.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

from megatron_ppo.startup.early_signals import OUTCOME_DIR, PREEMPTED_EXIT, SIGNALS, write_marker
from megatron_ppo.startup.import_gc import imports_without_gc

NPROC = "MEGATRON_PPO_NPROC"  # set for the workers: the resume command a worker prints launches as they were
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher")


@dataclass(frozen=True)
class Outcome:
    """What one worker decided: the exit status it returns and the text it has for the user."""

    rank: int
    status: int
    text: str


def tell_user(status: int, text: str, every_rank: bool = False) -> int:
    """Say `text` (this process's outcome, which it exits with `status`; "" for a run that ended as planned): under the
    launcher, written to the outcome folder for the launcher to print once; otherwise printed on stderr, by rank 0
    only unless `every_rank` (a traceback is each rank's own). Returns `status`."""
    from megatron_ppo.parallel import dist_env_from_environment

    rank = dist_env_from_environment().rank
    if folder := os.environ.get(OUTCOME_DIR):
        path = Path(folder) / f"rank{rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps({"status": status, "text": text}))
        path.with_suffix(".tmp").replace(path)  # whole or absent: the launcher never reads half an outcome
    elif text and (every_rank or rank == 0):
        print(text, file=sys.stderr, flush=True)
    return status


def read_outcomes(folder: Path) -> dict[int, Outcome]:
    """The outcomes the workers wrote to `folder`, by rank."""
    outcomes = {}
    for path in folder.glob("rank*.json"):
        rank = int(path.stem.removeprefix("rank"))
        written = json.loads(path.read_text())
        outcomes[rank] = Outcome(rank, int(written["status"]), str(written["text"]))
    return outcomes


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class Exit:
    """A worker that exited non-zero: its status (negative: the signal that ended it, as `subprocess` says) and
    when the agent saw it (whole seconds)."""

    status: int
    seconds: int


# The agent SIGTERMs the workers still running once one has failed, and SIGKILLs those still running 30 s later: a
# death by another signal, or by SIGKILL within this many seconds of the first failure, is not the agent's.
FIRST_FAILURES_S = 2


def conclude(outcomes: dict[int, Outcome], exits: dict[int, Exit], received: int | None, resume: str) -> Outcome:
    """The one outcome the launcher reports (module docstring, 3), from the workers' `outcomes`, those that exited
    non-zero (`exits`, by rank) and the signal the launcher `received` (None if none). Its `rank` is -1 where no
    worker's outcome is chosen."""
    first = min((e.seconds for e in exits.values()), default=0)
    died = sorted(r for r, e in exits.items() if r not in outcomes and e.status < 0 and -e.status != signal.SIGTERM
                  and e.seconds <= first + FIRST_FAILURES_S)  # fmt: skip
    if died:
        rank, number = died[0], -exits[died[0]].status
        return Outcome(-1, 128 + number, (
            f"error: rank {rank} died ({signal_name(number)}) without an error of its own; the other ranks stopped "
            "with it. Look for what ended it: the machine's memory (the kernel's out-of-memory killer: `dmesg`, or "
            "the job's memory limit), a `kill` or a node that went down. The last complete checkpoint is kept; "
            f"resume with: {resume}"))  # fmt: skip
    decided = [o for _, o in sorted(outcomes.items()) if o.status != 0] or [o for _, o in sorted(outcomes.items())]
    if received is None:  # a worker's stop by a signal came from the agent, after another's failure: that one speaks
        from megatron_ppo.train.preemption import INTERRUPTED_EXIT

        decided.sort(key=lambda o: o.status in (PREEMPTED_EXIT, INTERRUPTED_EXIT))  # stable: by rank within each
    if decided:
        return decided[0]
    failed = sorted(r for r, e in exits.items() if e.status > 0)
    if failed:
        rank, status = failed[0], exits[failed[0]].status
        return Outcome(-1, status, f"error: rank {rank} exited with status {status} without a message of "
                                   "megatron-ppo's; its output is above")  # fmt: skip
    if received is not None:
        if received in SIGNALS:  # a preemption before any worker could say anything: starting, nothing to save
            return Outcome(-1, PREEMPTED_EXIT, f"stopped early by {signal_name(received)} before training (its "
                                               "workers were starting): nothing new to save; exiting with "
                                               f"{PREEMPTED_EXIT}, requeued unless it was cancelled")  # fmt: skip
        return Outcome(-1, 128 + received, f"stopped by {signal_name(received)} before the workers said anything")
    return Outcome(-1, 0, "")


def run_workers(nproc: int, args: list[str]) -> tuple[dict[int, Exit], int | None]:
    """`python ARGS` in `nproc` processes under torch's elastic agent (rendezvous on a free local port, as
    `torchrun --standalone`; no restarts). Returns the workers that exited non-zero, by rank, and the signal that
    stopped the launcher, if one did."""
    with imports_without_gc():
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1)  # fmt: skip
    try:
        elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as failed:
        return {rank: Exit(f.exitcode, int(f.timestamp)) for rank, f in failed.failures.items()}, None
    except SignalException as stopped:
        return {}, int(stopped.sigval)
    return {}, None


def quiet_agent() -> None:
    """The agent's own log lines (its launch settings, "Sending process … closing signal SIGTERM", its failure
    report) stay off the user's screen; `MEGATRON_PPO_LOG_LEVEL` shows them."""
    if os.environ.get("MEGATRON_PPO_LOG_LEVEL"):
        return
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(logging.NullHandler())
        logger.propagate = False


def launch(nproc: int, worker_args: list[str], resume: str) -> int:
    """Run `python -m megatron_ppo WORKER_ARGS` in `nproc` workers and report their outcome once (module
    docstring); returns the exit status. `resume` is the command that resumes the run, for a rank that died."""
    quiet_agent()
    with tempfile.TemporaryDirectory(prefix="megatron-ppo-outcomes-") as folder:
        os.environ[OUTCOME_DIR], os.environ[NPROC] = folder, str(nproc)
        try:
            exits, received = run_workers(nproc, ["-m", "megatron_ppo", *worker_args])
        finally:
            del os.environ[OUTCOME_DIR], os.environ[NPROC]
        outcome = conclude(read_outcomes(Path(folder)), exits, received, resume)
    if outcome.rank == -1 and outcome.status == PREEMPTED_EXIT:  # no worker wrote the batch script's marker
        write_marker()
    if outcome.text:
        print(outcome.text, file=sys.stderr, flush=True)
    return outcome.status
