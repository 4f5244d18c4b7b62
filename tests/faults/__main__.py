"""`make faults`: every fault case of `cases.py` on the tiny recipe, through the real command line, as a table of
fault, what the user saw, exit status and what was kept; exit status 0 when every case holds.

    python -m tests.faults [--keep DIR] [NAME ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tests.faults.cases import CASES, base_run, run_case


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults")
    parser.add_argument("names", nargs="*", help="only these cases (default: all)")
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary one, removed)")
    args = parser.parse_args()
    cases = [case for case in CASES if not args.names or case.name in args.names]
    with tempfile.TemporaryDirectory(prefix="faults-") as temporary:
        directory = Path(args.keep or temporary)
        directory.mkdir(parents=True, exist_ok=True)
        console = Console(stderr=True)
        console.log(f"the base run (6 steps, checkpoints 2, 4, 6) in {directory}/base")
        base = base_run(directory / "base")
        table = Table(title="megatron-ppo · faults a user can cause (tiny recipe, one process)", show_lines=True)
        for column in ("fault", "what the user saw", "exit", "what was kept", ""):
            table.add_column(column, overflow="fold")
        failed = []
        for case in cases:
            console.log(f"case: {case.name}")
            outcome = run_case(case, base, directory / "cases")
            table.add_row(case.fault, outcome.saw, str(outcome.exit_code), outcome.kept, "ok" if outcome.ok else "FAIL")
            if not outcome.ok:
                failed.append(case.name)
                console.print(f"[red]{case.name}[/red]: output tail\n{outcome.log[-3000:]}")
        Console(width=200).print(table)
    print(
        f"{len(cases) - len(failed)} of {len(cases)} cases hold" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
