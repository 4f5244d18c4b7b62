"""Run a function on N CPU processes joined by gloo, as torchrun would, and collect what each returns.

The processes fork from one forkserver that has imported torch, megatron-core, this package and every worker module
once: a launch costs a fork, not the ~5 s of imports a spawned process pays (the distributed tier makes dozens). Each
launch still gets fresh processes: nothing one test's ranks do reaches another's.

A rank that crashes (a signal, an exit before answering) fails the launch at once, and one that has not answered by
the timeout fails it then; either way the failure shows that rank's Python stacks (faulthandler)."""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ports import on_a_free_port

# What the forkserver imports before it forks anything: the heavy libraries and every worker module here.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron_ppo.train.run", "megatron_ppo.convert.huggingface",
           *sorted(f"tests.distributed.{path.stem}" for path in Path(__file__).parent.glob("*workers.py"))]  # fmt: skip


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: mp.Queue, stacks: str) -> None:
    # what the failure shows of a rank that does not answer: its threads' stacks when it crashes (SIGSEGV, SIGABRT)
    # or when asked (SIGUSR1, on a timeout)
    stack_file = open(stacks, "w")  # noqa: SIM115 (written to until the process ends)
    faulthandler.enable(file=stack_file, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    try:
        # plain pickle (bytes): a tensor put on the queue as is travels as a shared-memory handle, which fails to
        # open once this process has exited before the parent reads it
        answer = (rank, "ok", pickle.dumps(fn(rank, world_size, *args)))
    except BaseException:
        answer = (rank, "error", traceback.format_exc())
    try:
        results.put(answer)
        results.close()
        results.join_thread()  # the answer is in the pipe before the teardown below, whatever becomes of it
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout_s: float = 300.0) -> list[Any]:
    """fn(rank, world_size, *args) on `world_size` fresh processes (one thread each, a fresh port); returns the
    results by rank, or raises with the first failing rank's traceback. A port taken by another process between
    `free_port()` and the rendezvous (two suites on one machine) is tried again on another port, twice at most."""
    return on_a_free_port(lambda port: _launch(fn, world_size, port, args, timeout_s))


def _launch(fn: Callable, world_size: int, port: int, args: tuple, timeout_s: float) -> list[Any]:
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        stacks = [os.path.join(folder, f"rank{rank}.stacks") for rank in range(world_size)]
        return _launch_with_stacks(fn, world_size, port, args, timeout_s, stacks)


def _launch_with_stacks(
    fn: Callable, world_size: int, port: int, args: tuple, timeout_s: float, stacks: list[str]
) -> list[Any]:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    results = context.Queue()
    processes = [
        context.Process(target=_child, args=(fn, rank, world_size, port, args, results, stacks[rank]), daemon=False)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size and not errors:
            missing = [rank for rank in range(world_size) if rank not in collected]
            # a rank's answer is in the pipe before it exits: one that had exited before this wait and is still
            # missing after it died without answering (a crash)
            exited = [rank for rank in missing if processes[rank].exitcode is not None]
            try:
                rank, status, value = results.get(timeout=1.0)
            except queue.Empty:
                if exited:
                    codes = ", ".join(f"rank {rank}: {processes[rank].exitcode}" for rank in exited)
                    errors.append(f"ranks {exited} exited without answering (exit codes {codes})")
                    errors.extend(_stacks_of(processes, exited, stacks))
                elif time.monotonic() > deadline:
                    errors.append(f"no answer within {timeout_s} s from ranks {missing}")
                    errors.extend(_stacks_of(processes, missing, stacks))
                continue
            if status == "ok":
                collected[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
    finally:
        for process in processes:  # a rank whose teardown hangs after its answer does not hold the suite
            process.join(timeout=5 if errors else 30)
            if process.is_alive():
                process.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[rank] for rank in range(world_size)]


def _stacks_of(processes: list, ranks: list[int], stacks: list[str]) -> list[str]:
    """The Python stacks of the ranks that did not answer, for the failure: written by faulthandler when the rank
    crashed, or now, asked by SIGUSR1, when it is still running."""
    running = [rank for rank in ranks if processes[rank].is_alive()]
    for rank in running:
        os.kill(processes[rank].pid, signal.SIGUSR1)
    if running:
        time.sleep(2)  # for faulthandler to write
    return [f"rank {rank}'s threads:\n{Path(stacks[rank]).read_text() or '(none written)'}" for rank in ranks]
