"""A validated config is read-only: `freeze` marks it and every section in it, and from then on assigning a field
raises `dataclasses.FrozenInstanceError` naming the dotted key. What changes during a run lives in the object that
owns it (the out-of-memory back-off's micro-batch sizes, the initial weights chosen at start), never in the config.

A config that differs on purpose (a comparison's variant, a test's case) is a new one: `with_changes` copies it with
some dotted keys replaced, frozen again.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

_PATH = "_frozen_path"  # set on a frozen section: its dotted prefix ("actor.megatron."); not a schema field


class Freezable:
    """Base of the schema's sections: a section marked by `freeze` refuses writes to its attributes."""

    def __setattr__(self, name: str, value: Any) -> None:
        _refuse_if_frozen(self, name)
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        _refuse_if_frozen(self, name)
        object.__delattr__(self, name)


def _refuse_if_frozen(section: Any, name: str) -> None:
    prefix = section.__dict__.get(_PATH)
    if prefix is not None:
        raise dataclasses.FrozenInstanceError(
            f"cannot assign {prefix}{name}: the config is read-only once validated; set it in the recipe or as an "
            "override, derive a changed copy (config.frozen.with_changes), or keep a run-time value in the object "
            "that owns it"
        )


def freeze[T](config: T, prefix: str = "") -> T:
    """Mark `config` and every section below it (also those inside lists) read-only; returns `config`."""
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        items = value if isinstance(value, list) else [value]
        for index, item in enumerate(items):
            if dataclasses.is_dataclass(item):
                where = f"{prefix}{field.name}" + (f"[{index}]" if isinstance(value, list) else "")
                freeze(item, f"{where}.")
    object.__setattr__(config, _PATH, prefix)
    return config


def with_changes[T](config: T, changes: Mapping[str, Any]) -> T:
    """A frozen copy of `config` (a deep copy: `config` itself is left as it was) with each dotted key of `changes`
    set to its value. Not validated again: derive only what validation passes, or validate the copy."""
    return freeze(_replaced(copy.deepcopy(config), nested(changes), ""))


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a.b.c": v} → {"a": {"b": {"c": v}}}: dotted keys as the nested dicts of their sections."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = value
    return tree


def _replaced(section: Any, tree: dict[str, Any], prefix: str) -> Any:
    names = {field.name for field in dataclasses.fields(section)}
    values = {}
    for name, change in tree.items():
        if name not in names:
            raise KeyError(f"{prefix}{name} is not a config key; known under {prefix or 'the top level'}: "
                           f"{', '.join(sorted(names))}")  # fmt: skip
        current = getattr(section, name)
        nested = isinstance(change, dict) and dataclasses.is_dataclass(current)
        values[name] = _replaced(current, change, f"{prefix}{name}.") if nested else change
    return dataclasses.replace(section, **values)
