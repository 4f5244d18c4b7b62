"""Prints, after a run, the largest difference from verl seen by each parity comparison."""

from tests.parity.helpers import LARGEST_DIFFERENCE


def pytest_terminal_summary(terminalreporter) -> None:
    if LARGEST_DIFFERENCE:
        terminalreporter.section("largest difference from verl 0.9.1")
        for name in sorted(LARGEST_DIFFERENCE):
            terminalreporter.write_line(f"{name:<48} {LARGEST_DIFFERENCE[name]:.3e}")
