"""`megatron_ppo.startup.lazy_modules`: W&B, which Megatron-Core imports with its timers, bound at once and executed at
its first use — in place, so Megatron's reference is the real module then — and not at all in a run that never uses
it."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest

from megatron_ppo.startup import lazy_modules
from tests.support.fresh_process import assert_in_a_fresh_process


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A package `lazy_probe` (its __init__ counts its executions in `runs.txt`, and imports a submodule that reads
    a name the package has not set yet), made lazy by `install()`; its counter file."""
    root = tmp_path / "lazy_probe"
    root.mkdir()
    runs = tmp_path / "runs.txt"
    (root / "__init__.py").write_text(
        f"import pathlib\nrun = pathlib.Path({str(runs)!r})\nrun.write_text(run.read_text() + 'x' if run.exists() "
        "else 'x')\nVALUE = 42\nfrom lazy_probe import part\nLATE = 1\n"
    )
    (root / "part.py").write_text(
        "import lazy_probe\nSEEN = lazy_probe.VALUE\ntry:\n    lazy_probe.LATE\nexcept AttributeError as error:\n"
        "    MISSING = str(error)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lazy_modules, "LAZY", ("lazy_probe", "lazy_probe_not_installed"))
    for name in ("lazy_probe", "lazy_probe.part"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    lazy_modules.install()
    yield runs
    for name in ("lazy_probe", "lazy_probe.part"):
        sys.modules.pop(name, None)


def test_a_bound_module_runs_at_its_first_attribute_and_only_then(package: Path) -> None:
    import lazy_probe

    assert not package.exists(), "bound, not executed"
    assert lazy_probe.__file__.endswith("__init__.py") and lazy_probe.__name__ == "lazy_probe"
    assert not package.exists(), "what inspect.getmodule reads of every module does not execute it"
    assert lazy_probe.VALUE == 42 and package.read_text() == "x"
    assert sys.modules["lazy_probe"] is lazy_probe and type(lazy_probe) is type(sys)
    # the submodule it imported while executing read what was set, and got a partial module's error for the rest
    assert lazy_probe.part.SEEN == 42 and "partially initialized" in lazy_probe.part.MISSING
    assert lazy_probe.LATE == 1 and package.read_text() == "x", "executed once"
    with pytest.raises(AttributeError):
        getattr(lazy_probe, "absent")  # noqa: B009 (an attribute read that must raise)


def test_importing_a_submodule_first_executes_the_package(package: Path) -> None:
    import lazy_probe.part

    assert package.read_text() == "x" and lazy_probe.part.SEEN == 42


def test_threads_reading_at_once_all_see_the_executed_module(package: Path) -> None:
    import lazy_probe

    seen: list[object] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            seen.append(lazy_probe.VALUE)
        except BaseException as error:  # any error fails the test below
            errors.append(error)

    threads = [threading.Thread(target=read) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and seen == [42] * 8 and package.read_text() == "x"


def test_a_module_not_installed_stays_absent(package: Path) -> None:
    assert "lazy_probe_not_installed" not in sys.modules
    with pytest.raises(ImportError):
        import lazy_probe_not_installed  # noqa: F401


def test_a_process_importing_the_trainer_executes_no_wandb_until_it_is_used() -> None:
    """In a fresh process, as every launched rank starts: Megatron's timers hold W&B not yet executed (its SDK not
    imported); the first use executes it, and Megatron's reference is then the real module."""
    assert_in_a_fresh_process(
        "import sys, importlib.metadata, megatron_ppo.train.run, megatron.core.timers as timers",
        "assert 'wandb.sdk' not in sys.modules and timers.wandb is sys.modules['wandb'], 'W&B was executed'",
        "import wandb; assert wandb.__version__ == importlib.metadata.version('wandb') and callable(wandb.init)",
        "assert timers.wandb is wandb and 'wandb.sdk' in sys.modules",
    )
