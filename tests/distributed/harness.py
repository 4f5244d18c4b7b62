"""Run a function on N CPU processes joined by gloo, as torchrun would, and collect what each returns.

The processes fork from one forkserver that has imported torch, megatron-core, this package and every worker module
once: a launch costs a fork, not the ~5 s of imports a spawned process pays (the distributed tier makes dozens). Each
launch still gets fresh processes: nothing one test's ranks do reaches another's."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.ports import on_a_free_port

# What the forkserver imports before it forks anything: the heavy libraries and every worker module here.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron_ppo.train.run", "megatron_ppo.convert.huggingface",
           *sorted(f"tests.distributed.{path.stem}" for path in Path(__file__).parent.glob("*workers.py"))]  # fmt: skip


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results: mp.Queue) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )  # fmt: skip
    import torch

    torch.set_num_threads(1)
    try:
        # plain pickle (bytes): a tensor put on the queue as is travels as a shared-memory handle, which fails to
        # open once this process has exited before the parent reads it
        results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
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
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    results = context.Queue()
    processes = [
        context.Process(target=_child, args=(fn, rank, world_size, port, args, results), daemon=False)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    collected: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                errors.append(
                    f"no answer within {timeout_s} s from ranks {sorted(set(range(world_size)) - set(collected))}"
                )
                break
            if status == "ok":
                collected[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        for process in processes:
            process.join(timeout=5 if errors else timeout_s)
            if process.is_alive():
                process.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[rank] for rank in range(world_size)]
