"""Helpers shared by the benchmarks: wall time, the process's peak resident memory, a scratch run's overrides, and
the command line every bench module takes (`--smallest`)."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def smallest(argv: Sequence[str] | None, doc: str | None) -> bool:
    """A bench module's command line: `--smallest` runs it at its smallest size, in seconds — the test suite's smoke
    run (`tests/distributed/test_bench_smoke.py`), which checks that it works, not what it measures; without it,
    the benchmark's own sizes (`make bench`)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0] if doc else None)
    parser.add_argument("--smallest", action="store_true", help="the smallest size (seconds; its numbers mean nothing)")
    return parser.parse_args(argv).smallest


def reset_peak_rss() -> None:
    """Reset the kernel's high-water mark of this process's resident memory (Linux: clear_refs 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("VmHWM not found in /proc/self/status")


def current_rss_mib(kind: str = "VmRSS") -> float:
    """This process's resident memory (VmRSS), or its private part (RssAnon), or its mapped files' (RssFile)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{kind}:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{kind} not found in /proc/self/status")


def measure(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, float]:
    """(median seconds, peak resident MiB above the level before the first timed call) of `fn`."""
    for _ in range(warmup):
        fn()
    reset_peak_rss()
    base = current_rss_mib()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak_rss_mib() - base


def scratch_overrides(name: str) -> list[str]:
    """The tiny recipe as a bench's scratch run: no task, random weights, no logger, a run of its own under
    outputs/bench/<name> that never resumes or prunes the tiny recipe's checkpoints."""
    scratch = f"outputs/bench/{name}"
    return ["data.task=null", "model.allow_random_init=true", "trainer.logger=[]", "trainer.total_training_steps=100",
            "trainer.resume_mode=disable", "trainer.overwrite=true", f"trainer.default_local_dir={scratch}/checkpoints",
            f"trainer.log_dir={scratch}/tensorboard"]  # fmt: skip
