"""Every config key is read by code: a key that nothing reads promises what the trainer does not do.

Each leaf of the schema must appear as an attribute (`.name`) or a string key (`"name"`) in the package outside
`config/`, or in `slurm/` — or be listed below with the reason it is read where this search cannot see it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

from megatron_ppo.config.schema import PPOConfig

REPO = Path(__file__).resolve().parents[2]
READ_ELSEWHERE = {
    "actor.clip_ratio": "the default of clip_ratio_low/high, filled in by config.validate.resolve",
}


def _leaves(schema: type, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, leaf name) of every non-section field."""
    for field in dataclasses.fields(schema):
        section = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(section):
            yield from _leaves(type(section), f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", field.name


def _unread() -> list[str]:
    sources = [p.read_text() for p in (REPO / "megatron_ppo").rglob("*.py") if "config" not in p.parts]
    sources += [p.read_text() for p in (REPO / "slurm").glob("*.py")]
    unread = []
    for key, name in _leaves(PPOConfig):
        pattern = re.compile(rf"\.{name}\b|[\"']{name}[\"']")
        if key not in READ_ELSEWHERE and not any(pattern.search(source) for source in sources):
            unread.append(key)
    return unread


def test_every_config_key_is_read_by_code() -> None:
    assert _unread() == [], "read these keys, refuse them in config/validate.py, or remove them"


def test_the_walk_reaches_nested_sections() -> None:
    keys = {key for key, _ in _leaves(PPOConfig)}
    assert {"actor.megatron.tensor_model_parallel_size", "algorithm.kl_ctrl.stage_unit", "data.addition.sft_lr"} <= keys
