"""Statements run in a new interpreter, as each launched rank starts: what a module does at import, seen whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def assert_in_a_fresh_process(*statements: str) -> None:
    """`python -c` of the statements (joined by `; `) from the repository root; fails with the process's stderr."""
    result = subprocess.run([sys.executable, "-c", "; ".join(statements)], cwd=REPO, capture_output=True, text=True,
                            check=False)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
