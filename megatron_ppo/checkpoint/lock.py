"""One writer per run directory: an advisory lock on `<trainer.default_local_dir>/.lock`, held by rank 0 of the job
that trains there for as long as its process lives.

The lock is `fcntl.flock` on the file (the kernel drops it when the holder dies, however it dies), and the file
says who holds it: host, pid, Slurm job id (and restart count), start time. A second job in the directory is
refused naming the holder (`RunDirectoryLocked`, exit 2). A file still naming a holder whose lock is gone was left
by a process that died without releasing it (SIGKILL, a node lost): its lock is taken over, and the start says so.
A Slurm requeue of the same job finds its own job id there and takes the lock over silently (the requeued job's
previous processes are gone). A clean exit empties the file.

flock is exclusive across nodes on local disks, NFSv4 and Lustre mounted with `-o flock`; a filesystem that keeps
flock per node refuses a second job on the same node only.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from megatron_ppo.config.errors import UserError

LOCK_FILE = ".lock"
_HELD: dict[Path, IO[str]] = {}  # directory → the open, locked file (this process's locks)


class RunDirectoryLocked(UserError):
    """Another live job holds the run directory."""


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    job_id: str | None
    started: str

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), os.environ.get("SLURM_JOB_ID"),
                   time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))  # fmt: skip

    def describe(self) -> str:
        job = f", Slurm job {self.job_id}" if self.job_id else ""
        return f"pid {self.pid} on {self.host}{job}, since {self.started}"


def acquire(directory: str | Path) -> str | None:
    """Take the lock of `directory` (created if need be) for this process; returns a line for the run's log when a
    dead holder's lock was taken over (None otherwise). Raises `RunDirectoryLocked` naming a live holder. Taking a
    lock this process already holds does nothing."""
    root = Path(directory).resolve()
    if root in _HELD:
        return None
    root.mkdir(parents=True, exist_ok=True)
    handle = (root / LOCK_FILE).open("a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read(handle)
        handle.close()
        who = holder.describe() if holder else "another process"
        raise RunDirectoryLocked(
            f"trainer.default_local_dir={str(root)!r} is in use by another job ({who}; lock file {root / LOCK_FILE}):"
            " two jobs writing one run's checkpoints would overwrite each other's steps; wait for it to end or stop it"
            " (scancel / kill), or give this run another trainer.default_local_dir"
        ) from None
    previous, me = _read(handle), Holder.this_process()
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps(me.__dict__) + "\n")
    handle.flush()
    _HELD[root] = handle
    if previous is None or (previous.job_id is not None and previous.job_id == me.job_id):
        return None  # a clean exit left the file empty, or this is a requeue of the same Slurm job
    return f"took over the lock of {root}: its holder ({previous.describe()}) ended without releasing it"


def release(directory: str | Path) -> None:
    """Give the lock back: empty the file (so the next job sees a clean exit) and unlock."""
    handle = _HELD.pop(Path(directory).resolve(), None)
    if handle is not None:
        handle.seek(0)
        handle.truncate()
        handle.flush()
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def _read(handle: IO[str]) -> Holder | None:
    handle.seek(0)
    try:
        return Holder(**json.loads(handle.read()))
    except (ValueError, TypeError):
        return None


@atexit.register
def _release_all() -> None:
    for directory in list(_HELD):
        release(directory)
