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

import gc
import random
from pathlib import Path
from typing import Any

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


def pytest_itemcollected(item: pytest.Item) -> None:
    """Each test's tier marker (its folder), `floor` on every unit test; a test that uses a costly session fixture
    must be in that fixture's worker group (`WORKER_GROUPS`)."""
    tier = _tier(Path(item.path).relative_to(Path(__file__).parent))
    if tier is not None:
        item.add_marker(tier)
    if tier == "unit":
        item.add_marker("floor")
    for fixture, modules in WORKER_GROUPS.items():
        if fixture in getattr(item, "fixturenames", ()) and Path(item.path).stem not in modules:
            raise pytest.UsageError(
                f"{item.nodeid} uses the session fixture {fixture}: add {Path(item.path).stem!r} to "
                f"WORKER_GROUPS[{fixture!r}] in tests/conftest.py, so that one pytest-xdist worker builds it once"
            )


def _tier(module: Path) -> str | None:
    """The tier of a test module, given by its path below tests/ (its folder's, `TIERS`)."""
    return TIERS.get(module.parts[0]) if len(module.parts) > 1 else None


# The order the tiers start in (a stable sort: each keeps its own order): the Slurm jobs and the end-to-end launches,
# minutes each, before the distributed tier's seconds, and the one-process tier's tests last, filling the workers
# (`make test`) as they free, so that they end together
START_ORDER = ("slurm", "e2e", "distributed", "unit")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported (torch, Megatron-Core, the package, every test module: ~1M objects) frozen: the
    one-process tier's tests allocate enough to start a full collection every few seconds, and each walked that heap
    again (tests/unit in one process, 2026-12-07: 8.6 of its 101 CPU-seconds were collections, 7.0 of 93 frozen)."""
    gc.freeze()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests in `START_ORDER` of their tiers."""
    rank = {tier: index for index, tier in enumerate(START_ORDER)}
    items.sort(key=lambda item: min((rank[m.name] for m in item.iter_markers() if m.name in rank), default=len(rank)))


# The modules whose tests use a costly session fixture (built once per worker): run on one worker together.
WORKER_GROUPS = {
    "tiny_work": ("test_fault_drill", "test_tiny_recipe"),
    "quick_run": ("test_faults", "test_two_runs_one_directory", "test_launcher"),
    "cluster": ("test_cluster_path", "test_slurm_jobs"),  # the local Slurm (tests/slurm/conftest.py)
}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown under `-p no:xdist`
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`-n N`: the one-process tier's tests one by one, the other tiers' whole modules to a worker (their module
    fixtures built once), and the modules of a `WORKER_GROUPS` group to one worker (`--dist loadgroup` would do it
    from markers, but pytest-xdist 3.8 renames the test ids to carry the group, and pytest 9 no longer reads the
    name it sets)."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # in collection order (`pytest_collection_modifyitems`): longest first
    grouped = {module: fixture for fixture, modules in WORKER_GROUPS.items() for module in modules}

    class ModuleGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = Path(nodeid.split("::", 1)[0])
            if module.parts[0] == "tests" and _tier(module.relative_to("tests")) == "unit":
                return nodeid
            return grouped.get(module.stem, str(module))

    return ModuleGroups(config, log)


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
