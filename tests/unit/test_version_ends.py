"""CI tests both ends of what `pyproject.toml` admits: the lock (`make test`) lies inside every range, and the floor
leg (`make test-floor`, requirements/floor.txt) pins each direct dependency it names at the range's lower bound —
torch and megatron-core among them, the two whose oldest releases our code bends for."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
FLOORED = ("torch", "megatron-core")


def _ranges() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = (Requirement(text) for text in project["dependencies"])
    return {canonicalize_name(r.name): r for r in requirements}


def _pins(name: str) -> dict[str, Version]:
    """`name==version` lines of requirements/<name> (comments skipped), by canonical package name."""
    lines = (ROOT / "requirements" / name).read_text().splitlines()
    pairs = (line.split()[0].split("==") for line in lines if "==" in line and not line.startswith("#"))
    return {canonicalize_name(package): Version(version) for package, version in pairs}


def test_lock_lies_in_every_range() -> None:
    lock = _pins("lock.txt")
    inside = {name for name, r in _ranges().items() if name in lock and lock[name] in r.specifier}
    outside = {name: str(lock.get(name)) for name in _ranges().keys() - inside}
    assert not outside, f"requirements/lock.txt is outside pyproject's ranges: {outside} (make lock)"


@pytest.mark.parametrize("name", FLOORED)
def test_floor_leg_covers(name: str) -> None:
    assert name in _pins("floor.txt"), f"requirements/floor.txt pins no {name}: the floor leg would test the lock's"


def test_floor_pins_sit_at_lower_bounds() -> None:
    floor, ranges = _pins("floor.txt"), _ranges()
    off = {}
    for name in floor.keys() & ranges.keys():
        lower = [Version(s.version) for s in ranges[name].specifier if s.operator == ">="]
        if lower != [floor[name]]:
            off[name] = f"floor.txt {floor[name]}, pyproject {ranges[name].specifier}"
    assert not off, f"the floor leg must pin each range's lower bound (>=): {off}"
