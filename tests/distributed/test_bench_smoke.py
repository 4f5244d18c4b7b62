"""Every benchmark of `make bench` (each `bench/bench_*.py`, found by name, so a new one is covered once it exists)
runs at its smallest size (`--smallest`, which each must offer) on the processes `make bench` gives it: a broken
benchmark is red here, not found the next time someone measures. What the numbers say is the benchmark's business;
that it runs to its printout, with nothing not-a-number in it, is this test's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.distributed import bench_workers
from tests.distributed.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
BENCHES = sorted(path.stem for path in (REPO / "bench").glob("bench_*.py"))


def processes_in_make_bench() -> dict[str, int]:
    """{module: processes} from the Makefile's `bench` target: `$(TORCHRUN) --nproc_per_node N -m bench.X` or
    `$(PY) -m bench.X` (one process)."""
    makefile = (REPO / "Makefile").read_text()
    target = re.search(r"^bench:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert target, "the Makefile has no `bench` target"
    return {
        match["module"]: int(match["n"] or 1)
        for match in re.finditer(r"(?:--nproc_per_node[ =](?P<n>\d+)\s+)?-m bench\.(?P<module>bench_\w+)", target[1])
    }


@pytest.mark.parametrize("name", BENCHES)
def test_the_benchmark_runs_at_its_smallest_size(name: str) -> None:
    processes = processes_in_make_bench()
    assert name in processes, f"bench/{name}.py is not run by `make bench`: add it to the Makefile's bench target"
    printed = run_distributed(bench_workers.smallest_run, processes[name], name, timeout_s=240)
    assert printed[0].strip(), f"{name} --smallest printed nothing on rank 0"
    assert not re.search(r"\bnan\b", printed[0], re.I), f"{name} --smallest printed a NaN:\n{printed[0]}"
