"""The one registration rule of `algo/`'s registries (policy losses, advantage estimators, KL estimators, loss
aggregations, KL controllers): a decorated function becomes the table's entry under each of its verl names, and a
name registered twice is an error. A registry's names are `tuple(REGISTRY)`; what the rest of the project must know
of an entry (a policy loss over whole rows, an estimator over groups) is said where it is registered, as a flag
that puts its names into the registry's set for that fact."""

from __future__ import annotations

from collections.abc import Callable


def registrar[Entry: Callable](
    table: dict[str, Entry], what: str, facts: dict[str, set[str]] | None = None
) -> Callable[..., Callable[[Entry], Entry]]:
    """`register(*names, **flags)` for `table`: the decorator that puts its function into `table` under every name;
    each flag set true (a key of `facts`) adds the names to that fact's set."""
    facts = facts or {}

    def register(*names: str, **flags: bool) -> Callable[[Entry], Entry]:
        if unknown := sorted(set(flags) - set(facts)):
            raise TypeError(f"{what}: no fact {unknown} to register (known: {sorted(facts)})")

        def decorate(fn: Entry) -> Entry:
            for name in names:
                if name in table:
                    raise ValueError(f"{what} {name!r} is registered twice")
                table[name] = fn
                for fact, on in flags.items():
                    if on:
                        facts[fact].add(name)
            return fn

        return decorate

    return register
