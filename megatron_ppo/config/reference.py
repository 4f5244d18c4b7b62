"""The configuration reference (docs/reference/config.md), generated from the schema: every key with its type,
default, rule, verl name and one-line meaning, each read from the field that defines it — never kept by hand.

`python -m megatron_ppo.config.reference docs/reference/config.md` writes it (`make docs` does, before building the
site); a key without its meaning (`fields.DOC`) stops the generation naming the key. The verl column names the verl
key that lands on ours (`verl_keys.alias`), looked up in verl's own generated Megatron trainer config, so a name is
shown only where verl has it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_ppo.config.fields import DOC, PER_JOB, SHARED_LAYOUT
from megatron_ppo.config.schema import ROLES, PPOConfig
from megatron_ppo.config.verl_keys import (
    FILTER_OVERLONG,
    GRADIENT_CHECKPOINTING,
    RECOMPUTE_ON,
    TRUNCATION,
    VERL_ALIASES,
)
from megatron_ppo.config.verl_keys import alias as verl_alias

VERL_CONFIG = "trainer/config/_generated_ppo_megatron_trainer.yaml"  # verl's whole Megatron trainer config, flattened
# Our keys set by a verl key's value rather than renamed from it (`verl_keys.expand_verl_values`)
VALUE_MAPPED = {
    **{f"{section}.{name}": verl for verl, section in GRADIENT_CHECKPOINTING.items() for name in RECOMPUTE_ON},
    "data.overlong_policy": f"{FILTER_OVERLONG}`, `{TRUNCATION}",
    "data.prompt_truncation": TRUNCATION,
}


@dataclass(frozen=True)
class Key:
    """One key of the schema as the reference prints it."""

    path: str  # dotted; an item of a list of sections as `list[].field`
    type: str
    default: str
    rule: str
    verl: str
    meaning: str


@dataclass(frozen=True)
class Section:
    path: str
    about: str
    keys: list[Key]


def sections(verl_keys: set[str]) -> list[Section]:
    """The schema's sections in order, each with its own keys (a nested section is a section of its own)."""
    return list(_walk(PPOConfig(), "", verl_keys))


def _walk(config: Any, prefix: str, verl_keys: set[str]) -> Iterator[Section]:
    hints = typing.get_type_hints(type(config))
    keys, nested = [], []
    for field in dataclasses.fields(config):
        value, path = getattr(config, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            nested.append((value, f"{path}."))
            continue
        keys.append(_key(field, hints[field.name], value, path, verl_keys))
        item = _item_type(hints[field.name])
        if item is not None:  # a list of sections: its items' keys follow as a section of their own
            nested.append((item(), f"{path}[]."))
    if keys:
        yield Section(prefix.rstrip("."), _about(type(config)), keys)
    for value, path in nested:
        yield from _walk(value, path, verl_keys)


def _key(field: dataclasses.Field, hint: Any, value: Any, path: str, verl_keys: set[str]) -> Key:
    if not field.metadata.get(DOC):
        raise ValueError(f"{path} has no meaning: give its field a doc (config/fields.py, DOC) in config/schema.py")
    return Key(path, _type_name(hint), _default(value), _rule(field.metadata, path), _verl_name(path, verl_keys),
               field.metadata[DOC])  # fmt: skip


def _about(schema: type) -> str:
    return " ".join((schema.__doc__ or "").split())


def _item_type(hint: Any) -> type | None:
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint)
        return item if dataclasses.is_dataclass(item) else None
    return None


def _type_name(hint: Any) -> str:
    if hint is type(None):
        return "null"
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return "list of sections" if dataclasses.is_dataclass(args[0]) else f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    return hint.__name__


def _value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{f.name}: {_value(getattr(value, f.name))}" for f in dataclasses.fields(value)) + "}"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_value(v)}" for k, v in value.items()) + "}"
    return repr(value) if value == "" else str(value)


def _default(value: Any) -> str:
    return f"`{_value(value)}`"


def _rule(metadata: Any, path: str) -> str:
    rules = []
    if "choices" in metadata:
        rules.append("one of " + ", ".join(f"`{_value(c)}`" for c in metadata["choices"]))
    if "item_choices" in metadata:
        rules.append("each one of " + ", ".join(f"`{_value(c)}`" for c in metadata["item_choices"]))
    if "range" in metadata:
        rules.append(metadata["range"].rule)
    if metadata.get(SHARED_LAYOUT) and path.split(".")[0] in ROLES:  # the reward model's layout is its own
        rules.append("the same in every role")
    if PER_JOB in metadata:
        rules.append(f"may differ between the jobs of a run ({metadata[PER_JOB]})")
    return "; ".join(rules)


def _verl_name(path: str, verl_keys: set[str]) -> str:
    """The verl keys that land on `path`: renamed (`VERL_ALIASES`, or the same name) where verl has them, or whose
    value sets it (`VALUE_MAPPED`)."""
    if path in VALUE_MAPPED:
        return f"from `{VALUE_MAPPED[path]}`"
    candidates = [path] + [verl + path[len(ours) :] for verl, ours in VERL_ALIASES.items()
                           if path == ours or (ours.endswith(".") and path.startswith(ours))]  # fmt: skip
    names = [c for c in candidates if c in verl_keys and _lands_on(c) == path]
    return ", ".join(f"`{n}`" for n in names)


def _lands_on(verl_key: str) -> str | None:
    try:
        return verl_alias(verl_key)
    except ValueError:  # a refused verl key lands nowhere
        return None


def verl_key_set() -> set[str]:
    """Every dotted key of verl's Megatron trainer config (read from the installed verl, not imported)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise SystemExit("the reference names verl's keys from verl's own config: pip install -e '.[verl]'")
    tree = yaml.safe_load((Path(spec.origin).parent / VERL_CONFIG).read_text())
    return set(_flat(tree, ""))


def _flat(tree: Any, prefix: str) -> Iterator[str]:
    if isinstance(tree, dict):
        for name, value in tree.items():
            yield f"{prefix}{name}"
            yield from _flat(value, f"{prefix}{name}.")


HEADER = """# Configuration reference

Every key of a megatron-ppo config: its type, default, rule (what `validate` refuses), the verl key that sets it
(verl-style overrides are accepted as aliases: [verl keys](verl-keys.md)) and what it does. Generated from the
schema (`megatron_ppo/config/schema.py`) by `python -m megatron_ppo.config.reference` (`make docs`); do not edit
it by hand. Rules across keys (batch divisibility, layouts, KL stages) are in [Recipes and the
planner](../recipes.md#validate-a-recipe). A rule "may differ between the jobs of a run" marks the keys a resumed
job may change without starting another experiment ([Checkpoints](../checkpoints.md)).
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render(all_sections: list[Section]) -> str:
    parts = [HEADER]
    for section in all_sections:
        parts.append(f"\n## {section.path}\n\n{_cell(section.about)}\n")
        parts.append("\n| key | type | default | rule | verl | meaning |\n|---|---|---|---|---|---|\n")
        for key in section.keys:
            cells = (f"`{key.path}`", key.type, key.default, key.rule, key.verl, key.meaning)
            parts.append("| " + " | ".join(_cell(c) for c in cells) + " |\n")
    return "".join(parts)


def main(argv: list[str]) -> int:
    text = render(sections(verl_key_set()))
    if not argv:
        print(text, end="")
        return 0
    Path(argv[0]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[0]).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
