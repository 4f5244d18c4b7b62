"""Markers by directory, so `pytest -m` can pick a tier without each test naming its own:

    unit         tests/unit, tests/parity: one process, seconds each
    distributed  tests/distributed: gloo process groups through Megatron (2–4 CPU processes)
    e2e          tests/e2e: the real CLI under torchrun (the tiny recipe and its variants)
    slurm        tests/slurm: jobs on a real single-node Slurm
    floor        the set also run on the oldest megatron-core and torch the package admits (`make test-floor`): every
                 unit test, and the distributed and e2e tests that mark themselves

`make test-fast` runs everything but e2e and slurm; `make test` runs all of it. `--shuffle SEED` runs the tests in an
order drawn from SEED (the modules shuffled, and the tests inside each: module fixtures are still built once), so a
test that leans on another's side effects shows; the seed is in the header, to repeat an order."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

TIERS = {"unit": "unit", "parity": "unit", "distributed": "distributed", "e2e": "e2e", "slurm": "slurm", "drill": "e2e"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--shuffle", metavar="SEED", type=int, default=None,
                     help="run the modules, and the tests inside each, in an order drawn from SEED")  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    for name, text in (
        ("unit", "one process, no process group"),
        ("distributed", "gloo process groups through Megatron"),
        ("e2e", "the real CLI under torchrun"),
        ("slurm", "jobs on a real single-node Slurm"),
        ("floor", "also run against the oldest megatron-core and torch the package admits"),
    ):
        config.addinivalue_line("markers", f"{name}: {text}")
    config.pluginmanager.register(_Shuffle(), "shuffle")


def pytest_report_header(config: pytest.Config) -> list[str]:
    import megatron.core
    import torch

    seed = config.getoption("--shuffle")
    return [
        f"megatron-core {megatron.core.__version__} ({Path(megatron.core.__file__).parent}), torch {torch.__version__}",
        *([f"tests shuffled: --shuffle {seed}"] if seed is not None else []),
    ]


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test's tier marker (its folder), and `floor` on every unit test."""
    tests_root = Path(__file__).parent
    for item in items:
        parts = Path(item.path).relative_to(tests_root).parts
        tier = TIERS.get(parts[0]) if len(parts) > 1 else None
        if tier is not None:
            item.add_marker(tier)
        if tier == "unit":
            item.add_marker("floor")


class _Shuffle:
    """`--shuffle SEED`: the order, drawn last (after pytest's own ordering by fixture and `-m`'s selection)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        _shuffle(config, items)


def _shuffle(config: pytest.Config, items: list[pytest.Item]) -> None:
    seed = config.getoption("--shuffle")
    if seed is not None:
        rng = random.Random(seed)
        modules: dict[Path, list[pytest.Item]] = {}
        for item in items:
            modules.setdefault(Path(item.path), []).append(item)
        groups = list(modules.values())
        rng.shuffle(groups)
        for group in groups:
            rng.shuffle(group)
        items[:] = [item for group in groups for item in group]
