"""The one error type of the config system: every problem found, each naming the key, the value and the fix."""

from __future__ import annotations


class ConfigError(ValueError):
    """Raised with all problems found at once, so a user fixes a recipe in one pass."""

    def __init__(self, problems: list[str], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        where = f" in {source}" if source else ""
        noun = "problem" if len(problems) == 1 else "problems"
        super().__init__(f"{len(problems)} config {noun}{where}:\n" + "\n".join(f"  - {p}" for p in problems))
