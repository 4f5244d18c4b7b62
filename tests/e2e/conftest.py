"""Fixtures shared by the end-to-end tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_work(tmp_path_factory) -> Path:
    """The shortened tiny recipe's task cache (tokenizer, SFT policy, offline data: `data.addition.work_dir`), built
    by the first run that uses it and reused by the others — the SFT stage is the slowest part of a short run. Every
    user passes the same task overrides (`bench.tiny.SHORT`), so the cache always matches the run reading it."""
    return tmp_path_factory.mktemp("tiny-work")
