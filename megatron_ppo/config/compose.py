"""Compose a config: recipe YAML ← `defaults:` files ← `key=value` overrides, then type-check, resolve, validate
and freeze.

Composition order (later wins): the files a recipe lists in `defaults:` (each may list its own), the recipe
itself, then command-line overrides. `defaults:` entries are paths without `.yaml`, looked up next to the file
that names them and then in `configs/` (or `$MEGATRON_PPO_CONFIG_DIR`). Lists are replaced, not merged.
Overrides take Hydra's forms too: `+key=value` sets a key (every key of the schema exists already, so `+` adds
nothing the schema lacks) and `~key` deletes one (the schema default applies). verl's paths are read as verl means
them (`config/verl_keys.py`), and a problem with such a key names the key the user wrote.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.frozen import freeze
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.config.validate import resolve, validate
from megatron_ppo.config.verl_keys import (
    AS_WRITTEN,
    ONE_PATH_OR_LIST,
    VERL_ALIASES,
    Override,
    alias,
    expand_verl_values,
)

__all__ = ["VERL_ALIASES", "build_config", "compose_file", "load_config", "parse_override"]

# `megatron_ppo/configs` is a link to the repository's `configs/` in the source tree and the copied folder in a wheel.
CONFIG_DIR = Path(os.environ.get("MEGATRON_PPO_CONFIG_DIR", Path(__file__).resolve().parents[1] / "configs"))


def load_config(recipe: str | Path, overrides: Sequence[str] = ()) -> PPOConfig:
    """Compose, override, type-check, resolve and validate; raises `ConfigError` listing every problem."""
    recipe = Path(recipe)
    raw = compose_file(recipe)
    parsed = expand_verl_values([parse_override(override) for override in overrides])
    for override in parsed:
        if override.delete:
            _delete(raw, override.key)
        else:
            OmegaConf.update(raw, override.key, override.value, merge=True, force_add=True)
    try:
        return build_config(raw, source=str(recipe))
    except ConfigError as error:
        raise ConfigError([_name_written_keys(p, parsed) for p in error.problems], error.source) from None


def build_config(raw: DictConfig, source: str | None = None) -> PPOConfig:
    """Typed config from a composed tree: unknown keys and wrong types first, then resolution and validation; the
    result is frozen (`config.frozen`)."""
    problems = unknown_key_problems(OmegaConf.to_container(raw, resolve=False), PPOConfig)
    if problems:
        raise ConfigError(problems, source)
    _one_path_as_list(raw)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(PPOConfig), raw)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as error:
        raise ConfigError([_describe_omegaconf_error(error)], source) from None
    resolve(config)
    problems = validate(config)
    if problems:
        raise ConfigError(problems, source)
    return freeze(config)


def _one_path_as_list(raw: DictConfig) -> None:
    """`data.train_files` / `data.val_files` given as one path become a list of it (verl takes either), in place."""
    data = raw.get("data")
    for key in ONE_PATH_OR_LIST:
        if isinstance(data, DictConfig) and isinstance(data.get(key), str):
            data[key] = [data[key]]


def compose_file(path: Path, _stack: tuple[Path, ...] = ()) -> DictConfig:
    """The file's tree merged over its `defaults:` (recursively)."""
    path = path.resolve()
    if path in _stack:
        chain = " -> ".join(str(p) for p in (*_stack, path))
        raise ConfigError([f"defaults form a cycle: {chain}; remove one of the entries"])
    if not path.is_file():
        raise ConfigError([f"config file {path} does not exist"])
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as error:
        raise ConfigError([f"{path} is not valid YAML: {error}"]) from None
    if not isinstance(node, DictConfig):
        raise ConfigError([f"{path} must hold a mapping of config groups, found a {type(node).__name__}"])
    defaults = node.pop("defaults", [])
    if not isinstance(defaults, ListConfig | list):
        raise ConfigError([f"{path}: defaults must be a list of config paths like [defaults, kl/staged]"])
    composed = OmegaConf.create()
    for entry in defaults:
        composed = OmegaConf.merge(composed, compose_file(_find_default(str(entry), path), (*_stack, path)))
    return OmegaConf.merge(composed, node)


def parse_override(override: str) -> Override:
    """`a.b.c=value` → our dotted key and its YAML-parsed value (verl paths renamed); Hydra's `+a.b.c=value` sets it
    too, `~a.b.c` (or `~a.b.c=value`) deletes it."""
    text = override.strip()
    delete, added = text.startswith("~"), text.startswith("+")
    key, sep, value = text.lstrip("~+").partition("=")
    key = key.strip()
    if not key or not (sep or delete):
        raise ConfigError(
            [f"override {override!r} is not of the form key=value (e.g. actor.optim.lr=1e-6), +key=value or ~key"]
        )
    ours = alias(key)
    try:
        parsed = None if delete else value.strip() if ours in AS_WRITTEN else _parse_value(value)
    except ValueError as error:
        raise ConfigError([f"override {override!r}: {error}"]) from None
    return Override(ours, parsed, key, delete=delete, added=added)


def _delete(raw: DictConfig, key: str) -> None:
    """Hydra's `~key`: drop the key from the composed tree, so the schema default applies. A key the schema lacks is
    an error (there is nothing to delete); one the YAML files never set is at its default already."""
    parent_key, _, leaf = key.rpartition(".")
    if key not in _all_paths(PPOConfig) and not any(path.startswith(f"{key}.") for path in _all_paths(PPOConfig)):
        raise ConfigError([f"override ~{key}: unknown key, nothing to delete{_suggest_path(key)}"])
    parent = OmegaConf.select(raw, parent_key) if parent_key else raw
    if isinstance(parent, DictConfig) and leaf in parent:
        parent.pop(leaf)


def _name_written_keys(problem: str, overrides: list[Override]) -> str:
    """`problem`, naming the keys as the user wrote them where they were verl paths, and saying that a Hydra `+`
    does not make an unknown key known."""
    unknown = re.match(r"unknown key '([^']+)'", problem)
    notes = []
    for override in overrides:
        if unknown is not None:
            named = override.key == unknown[1] or override.key.startswith(f"{unknown[1]}.")
        else:
            named = re.search(rf"(?<![\w.]){re.escape(override.key)}(?![\w])", problem) is not None
        if not named:
            continue
        note = f"{override.written} sets {override.key}" if override.written != override.key else None
        if unknown is not None and override.added:
            note = (f"+{override.written}: Hydra's + adds a key to a Hydra config, but megatron-ppo's schema is fixed "
                    "and + does not make an unknown key known")  # fmt: skip
        if note is not None and note not in notes:
            notes.append(note)
    return problem + (f" (you wrote: {'; '.join(notes)})" if notes else "")


def _parse_value(text: str) -> Any:
    """The override's value as YAML reads it; text YAML cannot read stays text (a path with a colon), but not one
    opening a list or a mapping (`[a.jsonl` would otherwise be a file name beginning with `[`): `ValueError`."""
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError as error:
        if text.lstrip().startswith(("[", "{")):
            closing = "]" if text.lstrip().startswith("[") else "}"
            raise ValueError(
                f"{text!r} opens a YAML {'list' if closing == ']' else 'mapping'} that does not parse "
                f"({str(error).splitlines()[0]}); close it with {closing!r}, or quote the value"
            ) from None
        return text
    if isinstance(value, str) and re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+", value.strip()):
        return float(value)  # YAML 1.1 reads 1e-6 as a string
    return value


def unknown_key_problems(tree: Any, schema: type, prefix: str = "") -> list[str]:
    """Keys in `tree` that the dataclass `schema` does not have, with the closest known names."""
    if not isinstance(tree, dict):
        return []
    fields = {f.name: f for f in dataclasses.fields(schema)}
    problems = []
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if key not in fields:
            problems.append(f"unknown key {path!r}{_suggest(str(key), list(fields), prefix)}")
            continue
        child = _dataclass_of(schema, key)
        if child is not None and isinstance(value, dict):
            problems += unknown_key_problems(value, child, f"{path}.")
        elif child is not None and isinstance(value, list):
            for index, item in enumerate(value):
                problems += unknown_key_problems(item, child, f"{path}[{index}].")
    return problems


def _dataclass_of(schema: type, name: str) -> type | None:
    """The dataclass held by field `name` (directly or as list items), if any."""
    hints = typing.get_type_hints(schema)
    hint = hints.get(name)
    for candidate in (hint, *getattr(hint, "__args__", ())):
        if dataclasses.is_dataclass(candidate):
            return candidate
    return None


def _suggest_path(key: str) -> str:
    close = difflib.get_close_matches(key, _all_paths(PPOConfig), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _suggest(key: str, siblings: list[str], prefix: str) -> str:
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix + close[0]!r}?"
    elsewhere = [path for path in _all_paths(PPOConfig) if path.rsplit(".", 1)[-1] == key]
    if elsewhere:
        return f"; {key!r} lives at {' or '.join(repr(p) for p in elsewhere)}"
    return f"; known keys here: {', '.join(sorted(siblings))}"


def _all_paths(schema: type, prefix: str = "") -> list[str]:
    paths = []
    for f in dataclasses.fields(schema):
        child = _dataclass_of(schema, f.name)
        paths += _all_paths(child, f"{prefix}{f.name}.") if child else [f"{prefix}{f.name}"]
    return paths


def _describe_omegaconf_error(error: OmegaConfBaseException) -> str:
    key = getattr(error, "full_key", "") or "?"
    message = str(getattr(error, "msg", error)).split("\n")[0]
    return f"{key}: {message}; give a value of the type the schema declares (megatron_ppo/config/schema.py)"


def _find_default(entry: str, including_file: Path) -> Path:
    name = entry if entry.endswith(".yaml") else f"{entry}.yaml"
    candidates = [including_file.parent / name, CONFIG_DIR / name]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    available = sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml"))
    suggestion = difflib.get_close_matches(entry, available, n=1)
    hint = f"did you mean {suggestion[0]!r}? " if suggestion else ""
    raise ConfigError(
        [
            f"{including_file}: defaults entry {entry!r} not found in {including_file.parent} or {CONFIG_DIR}; "
            f"{hint}available: {', '.join(available)}"
        ]
    )
