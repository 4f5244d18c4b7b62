"""The one registration rule of `algo/`'s registries (policy losses, advantage estimators, KL estimators, loss
aggregations, KL controllers): a decorated function becomes the table's entry under each of its verl names, and a
name registered twice is an error."""

from __future__ import annotations

from collections.abc import Callable


def registrar[Entry: Callable](table: dict[str, Entry], what: str) -> Callable[..., Callable[[Entry], Entry]]:
    """`register(*names)` for `table`: the decorator that puts its function into `table` under every name."""

    def register(*names: str) -> Callable[[Entry], Entry]:
        def decorate(fn: Entry) -> Entry:
            for name in names:
                if name in table:
                    raise ValueError(f"{what} {name!r} is registered twice")
                table[name] = fn
            return fn

        return decorate

    return register
