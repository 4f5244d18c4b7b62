"""Spawned-rank code for the benchmarks' smoke test: a bench module's `main` at its smallest size, its printout."""

from __future__ import annotations

import contextlib
import importlib
import io


def smallest_run(rank: int, world_size: int, name: str) -> str:
    """`bench.<name>.main(["--smallest"])` on this rank; what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        importlib.import_module(f"bench.{name}").main(["--smallest"])
    return printed.getvalue()
