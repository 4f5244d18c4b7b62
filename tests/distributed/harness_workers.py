"""Ranks that fail the way the harness must report: one crashes, one never answers."""

from __future__ import annotations

import os
import time


def answers(rank: int, world_size: int) -> int:
    return rank


def rank1_aborts(rank: int, world_size: int) -> int:
    if rank == 1:
        os.abort()  # SIGABRT: no answer, no Python exception
    return rank


def rank0_sleeps(rank: int, world_size: int) -> int:
    if rank == 0:
        time.sleep(600)
    return rank
