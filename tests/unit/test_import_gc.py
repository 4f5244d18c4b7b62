"""`megatron_ppo.startup.import_gc`: a process's heavy imports run with the cyclic garbage collector paused, and what
they built is frozen after (never walked by a later collection); the collector is back on whatever the body does, and a
collector the program had turned off stays off."""

from __future__ import annotations

import gc
import importlib
import sys
from pathlib import Path

import pytest

from megatron_ppo.startup.import_gc import imports_without_gc
from tests.support.fresh_process import assert_in_a_fresh_process


def _tracked(thing: object) -> bool:
    """Whether a collection may walk `thing` (frozen objects are in no generation `gc.get_objects` lists)."""
    return any(o is thing for o in gc.get_objects())


@pytest.fixture
def module_to_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The name of a module no one has imported yet (written for the test)."""
    (tmp_path / "import_gc_probe.py").write_text("VALUE = {'built': [1, 2]}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "import_gc_probe", raising=False)
    return "import_gc_probe"


def test_the_body_runs_without_the_collector_and_what_it_imported_is_frozen(module_to_import: str) -> None:
    assert gc.isenabled()
    with imports_without_gc():
        assert not gc.isenabled()
        module = importlib.import_module(module_to_import)
        assert _tracked(module.VALUE)
    assert gc.isenabled()
    assert not _tracked(module.VALUE)


def test_a_body_that_imports_nothing_freezes_nothing() -> None:
    """A second command in one process: its modules are there already, and what it would freeze is the garbage of
    what ran before."""
    with imports_without_gc():
        built = {"garbage": [1]}
    assert gc.isenabled() and _tracked(built)


def test_an_error_in_the_body_turns_the_collector_back_on() -> None:
    with pytest.raises(ImportError), imports_without_gc():
        raise ImportError("no module named 'missing'")
    assert gc.isenabled()


def test_a_collector_turned_off_outside_is_left_off_and_freezes_nothing(module_to_import: str) -> None:
    gc.disable()
    try:
        with imports_without_gc():
            module = importlib.import_module(module_to_import)
        assert not gc.isenabled()
        assert _tracked(module.VALUE)
    finally:
        gc.enable()


def test_nested_uses_freeze_once_at_the_outermost(module_to_import: str) -> None:
    with imports_without_gc():
        with imports_without_gc():
            module = importlib.import_module(module_to_import)
        assert not gc.isenabled() and _tracked(module.VALUE)
    assert gc.isenabled() and not _tracked(module.VALUE)


def test_a_worker_imports_the_trainer_without_collecting_and_freezes_it() -> None:
    """`train` as a worker runs it: the trainer's modules imported with no collection (~6 full ones walking the
    growing heap before) and frozen; the collector on again for the run (here a recipe that is not there: exit 2)."""
    assert_in_a_fresh_process(
        "import gc, sys",
        "from megatron_ppo import cli",
        "collected = []",
        "gc.callbacks.append(lambda phase, info: phase == 'start' and 'megatron.core' in sys.modules"
        " and 'megatron_ppo.train.run' not in sys.modules and collected.append(info['generation']))",
        "status = cli.main(['train', 'no-such-recipe.yaml'])",
        "assert status == 2, status",
        "assert 'megatron_ppo.train.run' in sys.modules and gc.isenabled()",
        "assert not collected, f'collections while the trainer was imported: {collected}'",
        "run = sys.modules['megatron_ppo.train.run'].__dict__",
        "assert not any(o is run for o in gc.get_objects()), 'the trainer module is not frozen'",
    )
