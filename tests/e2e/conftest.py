"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.cases import base_run


@pytest.fixture(scope="session")
def tiny_work(tmp_path_factory) -> Path:
    """The shortened tiny recipe's task cache (tokenizer, SFT policy, offline data: `data.addition.work_dir`), built
    by the first run that uses it and reused by the others — the SFT stage is the slowest part of a short run. Every
    user passes the same task overrides (`bench.tiny.SHORT`), so the cache always matches the run reading it."""
    return tmp_path_factory.mktemp("tiny-work")


@pytest.fixture(scope="session")
def quick_run(tmp_path_factory) -> Path:
    """One finished quick run (`tests.faults.cases.QUICK`: one process, a weak quick SFT start, 6 steps, checkpoints
    at 2, 4 and 6): its folder (`ckpt/`, `tb/`, the task cache `work/`). Never changed: each test that starts from
    it works on its own copy (the fault cases, the two runs in one directory)."""
    return base_run(tmp_path_factory.mktemp("quick-run"))
