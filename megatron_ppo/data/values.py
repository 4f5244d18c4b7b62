"""Checks of single row values (numbers, per-token lists, token ids), each failing with a counted kind and a
message that says what was found and what was expected."""

from __future__ import annotations

import json
import math
from typing import Any


class BadRow(Exception):
    """A row that fails validation: `kind` is the counted category, `problem` the readable explanation."""

    def __init__(self, kind: str, problem: str) -> None:
        super().__init__(problem)
        self.kind, self.problem = kind, problem


def describe(value: Any) -> str:
    """A value as a user wrote it: its JSON type and a short excerpt."""
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"
    )
    text = json.dumps(value, default=str)
    return f"{kind} {text[:57] + '...' if len(text) > 60 else text}"


def finite_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRow("wrong_type", f"{what} is {describe(value)}; expected a number")
    if not math.isfinite(value):
        raise BadRow("non_finite", f"{what} is {value}; expected a finite number")
    return float(value)


def per_token(record: dict[str, Any], key: str, num_tokens: int, counted: str) -> list[float] | None:
    """`record[key]` as a list of `num_tokens` finite numbers, one per response token; None when absent.
    `counted` says which tokens those are, for the message (e.g. "eos not included")."""
    values = record.get(key)
    if values is None:
        return None
    if not isinstance(values, list):
        raise BadRow(
            "wrong_type",
            f"'{key}' is {describe(values)}; expected a list of {num_tokens} numbers, one per response token",
        )
    if len(values) != num_tokens:
        raise BadRow(
            "length_mismatch",
            f"'{key}' has {len(values)} entries but the response has {num_tokens} "
            f"tokens; expected {num_tokens}, one per response token ({counted})",
        )
    return [finite_number(v, f"'{key}'[{i}]") for i, v in enumerate(values)]


def token_ids(record: dict[str, Any], key: str, vocab_size: int) -> list[int]:
    """`record[key]` as a non-empty list of integer token ids in [0, vocab_size)."""
    ids = record.get(key)
    if ids is None:
        raise BadRow("missing_field", f"'{key}' is missing; token-id rows give both 'prompt_ids' and 'response_ids'")
    if not isinstance(ids, list) or not ids:
        raise BadRow("wrong_type", f"'{key}' is {describe(ids)}; expected a non-empty list of integer token ids")
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise BadRow("wrong_type", f"'{key}'[{i}] is {describe(token)}; expected an integer token id")
        if not 0 <= token < vocab_size:
            raise BadRow(
                "token_out_of_vocab",
                f"'{key}'[{i}] = {token} is outside the tokenizer's vocabulary [0, {vocab_size}); the ids must come "
                "from the tokenizer named by model.tokenizer",
            )
    return ids
