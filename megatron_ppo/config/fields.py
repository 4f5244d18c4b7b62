"""Schema fields that carry their own rule — the values a key may take, or its valid range — and their one-line
meaning, so the schema is the one place a rule or a meaning is written: `validate` walks the fields, modules ask
`choices_of` instead of restating them, and the configuration reference (`config/reference.py`,
docs/reference/config.md) is generated from them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Range:
    """A range rule: `check(value)` holds for valid values; `rule` completes "must be …" in the error."""

    check: Callable[[Any], bool]
    rule: str


AT_LEAST_ONE = Range(lambda v: v >= 1, "≥ 1")
NON_NEGATIVE = Range(lambda v: v >= 0, "≥ 0")
POSITIVE = Range(lambda v: v > 0, "> 0")
COEFFICIENT = Range(lambda v: v >= 0, "≥ 0 (a coefficient)")
UNIT_INTERVAL = Range(lambda v: 0 <= v <= 1, "in [0, 1]")
FACTOR = Range(lambda v: 0 < v <= 1, "in (0, 1]")


DOC = "doc"  # the metadata key of a field's one-line meaning (what the configuration reference prints)


def _doc(doc: str) -> dict[str, str]:
    return {DOC: doc} if doc else {}


def choice(default: Any, options: Sequence[Any], doc: str = "") -> Any:
    """A field whose value must be one of `options` (the default among them); `doc` is its one-line meaning."""
    assert default in options, f"default {default!r} is not among {options}"
    return dataclasses.field(default=default, metadata={"choices": tuple(options), **_doc(doc)})


def ranged(default: Any, rule: Range, doc: str = "") -> Any:
    """A field whose value, unless None, must satisfy `rule`; `doc` is its one-line meaning."""
    return dataclasses.field(default=default, metadata={"range": rule, **_doc(doc)})


def described(default: Any = dataclasses.MISSING, doc: str = "", *, default_factory: Any = dataclasses.MISSING,
              **metadata: Any) -> Any:  # fmt: skip
    """A field without a rule of its own (any value of its type), with its one-line meaning `doc`; a list default
    comes as `default_factory`."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={**metadata, **_doc(doc)})


def each_of(options: Sequence[Any], **metadata: Any) -> dict[str, Any]:
    """The metadata of a list field each of whose items must be one of `options`: `described(default_factory=…,
    doc=…, **each_of(options))`."""
    return {"item_choices": tuple(options), **metadata}


SHARED_LAYOUT = "shared_layout"  # the metadata key of the layout fields every role must set alike


def shared_layout(spec: Any) -> Any:
    """A layout field (`MegatronConfig`) every role must set alike: Megatron's parallel_state holds one layout per
    process, and roles with different layouts would need per-model process groups, which the trainer does not
    build. `spec` is a field (`ranged`, `choice`) whose rule and default it keeps."""
    return dataclasses.field(default=spec.default, metadata={**spec.metadata, SHARED_LAYOUT: True})


PER_JOB = "per_job"  # the metadata key of `per_job` fields


def per_job(spec: Any, why: str, doc: str = "") -> Any:
    """A field the jobs of one run may set differently without it being another experiment
    (`run_identity.meant_to_change`); `why` names the kind (run control, the run's length, micro-batching). `spec` is
    the default (then `doc` is its meaning), or a field (`choice`, `ranged`) whose rule, default and meaning it keeps.
    (A list default: `described(default_factory=…, doc=…, per_job=why)`.)"""
    if not isinstance(spec, dataclasses.Field):
        return dataclasses.field(default=spec, metadata={PER_JOB: why, **_doc(doc)})
    return dataclasses.field(default=spec.default, metadata={**spec.metadata, PER_JOB: why, **_doc(doc)})


def tagged_keys(config: Any, tag: str, prefix: str = "") -> dict[str, Any]:
    """dotted key → its field's metadata `tag`, for every field of the (nested) dataclass `config` that carries it."""
    found = {}
    for field in dataclasses.fields(config):
        value, key = getattr(config, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            found |= tagged_keys(value, tag, f"{key}.")
        elif tag in field.metadata:
            found[key] = field.metadata[tag]
    return found


def choices_of(schema: type, name: str) -> tuple[Any, ...]:
    """The allowed values of field `name` of the dataclass `schema`."""
    return next(f for f in dataclasses.fields(schema) if f.name == name).metadata["choices"]


def field_problems(config: Any, prefix: str = "") -> list[str]:
    """Every value in the (nested) dataclass `config` that breaks its field's choices or range rule; list items are
    walked too (a list of sections, `guards.watch`, or of choices, `trainer.logger`)."""
    problems = []
    for field in dataclasses.fields(config):
        value, key = getattr(config, field.name), f"{prefix}{field.name}"
        if dataclasses.is_dataclass(value):
            problems += field_problems(value, f"{key}.")
        elif isinstance(value, list) and any(dataclasses.is_dataclass(item) for item in value):
            for index, item in enumerate(value):
                problems += field_problems(item, f"{key}[{index}].")
        elif "item_choices" in field.metadata:
            allowed = field.metadata["item_choices"]
            if unknown := [item for item in value if item not in allowed]:
                problems.append(f"{key}={value!r}: unknown {unknown}; use any of {', '.join(map(repr, allowed))}")
        elif "choices" in field.metadata and value not in field.metadata["choices"]:
            problems.append(f"{key}={value!r} is not one of {', '.join(map(repr, field.metadata['choices']))}")
        elif "range" in field.metadata and value is not None and not field.metadata["range"].check(value):
            problems.append(f"{key}={value!r}: must be {field.metadata['range'].rule}")
    return problems
