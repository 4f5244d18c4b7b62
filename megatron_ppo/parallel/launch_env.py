"""Where this process sits in its job, read from what torchrun or Slurm put in the environment. Standard library only:
commands that start no process group (validate, plan, report) read it without importing torch.distributed or
megatron-core."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 29500  # torchrun's and Slurm's jobs without MASTER_PORT: every rank must know the same port
ANY_FREE_PORT = 0  # a single process without MASTER_PORT: the OS picks one as the rendezvous binds (no peer asks)


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def dist_env_from_environment(environ: Mapping[str, str] | None = None) -> DistEnv:
    """torchrun's RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT, else Slurm's SLURM_PROCID/SLURM_NTASKS/
    SLURM_LOCALID with the master on the first host of SLURM_JOB_NODELIST; a single process otherwise, on MASTER_PORT
    when it is set, else on a port the OS picks as the rendezvous binds it: two single-process runs on one machine
    never collide, and no port is chosen before its bind (which another process could take in between)."""
    env = os.environ if environ is None else environ
    port = int(env.get("MASTER_PORT", DEFAULT_PORT))
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=port,
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=env.get("MASTER_ADDR", first_host(nodelist)),
            master_port=port,
        )
    port = int(env.get("MASTER_PORT", ANY_FREE_PORT))
    return DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1", master_port=port)


def first_host(nodelist: str) -> str:
    """First host of a Slurm node list: "gpu[003-005,010],cpu01" → "gpu003" (zero padding kept)."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = match.groups()
    if ranges is None:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return f"{prefix}{first}"
