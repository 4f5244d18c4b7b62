"""The fault cases that lose data when handled wrong (`tests/faults/cases.py`, `make faults` for all of them), through
the real command line: each must end with its exit status and one-line message, and keep what it must."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.faults.cases import CASES, run_case


@pytest.mark.parametrize("case", [c for c in CASES if c.in_tests], ids=lambda c: c.name.replace(" ", "-"))
def test_fault(case, quick_run: Path, tmp_path: Path) -> None:
    outcome = run_case(case, quick_run, tmp_path)
    assert outcome.ok, (
        f"{case.name}: exit {outcome.exit_code}, saw {outcome.saw!r}, kept {outcome.kept}\n" + (outcome.log[-4000:])
    )
