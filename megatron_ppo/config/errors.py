"""The errors a user causes and fixes. `UserError` is their common type: the command line prints its message as one
`error:` block (once, by rank 0) and exits 2; anything else reaching it is a bug, printed with its traceback and a
line saying so (`cli.main`). `ConfigError` is the config system's: every problem found, each naming the key, the
value and the fix."""

from __future__ import annotations


class UserError(Exception):
    """A problem in what the user gave (config, data, a checkpoint, a directory, the launch): the message names the
    file, key or line and what to change. Every such error type of the package derives from it (the test
    `tests/unit/test_error_contract.py` walks them)."""


class ConfigError(UserError, ValueError):
    """Raised with all problems found at once, so a user fixes a recipe in one pass."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"{len(problems)} config {noun}{where}:\n" + "\n".join(f"  - {p}" for p in problems))
