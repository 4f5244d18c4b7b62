"""Checks of single row values (numbers, per-token lists, token ids), each failing with a counted kind and a
message that says what was found and what was expected."""

from __future__ import annotations

import json
import math
from typing import Any, NamedTuple

import torch


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


class RoutingShape(NamedTuple):
    """What a row's `routed_experts` must match: the model's layers, its top-k and its experts."""

    num_layers: int
    topk: int
    num_experts: int


def routed_experts(record: dict[str, Any], key: str, shape: RoutingShape, num_tokens: int) -> torch.Tensor:
    """`record[key]` — per input token (prompt then response; the last may be missing, as an inference engine
    never routes the token it sampled last), per layer, the top-k expert indices — as a `[tokens, layers, k]`
    tensor of `torch.int32`, checked against the model's `shape`."""
    values = record.get(key)
    if values is None:
        raise BadRow("missing_field", f"'{key}' is missing; actor.router_replay.mode=R3 replays every row's "
                     f"routing: expected [{num_tokens} tokens][{shape.num_layers} layers][{shape.topk}] expert "
                     "indices")  # fmt: skip
    try:
        experts = torch.tensor(values, dtype=torch.long)
    except (TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise BadRow("wrong_type", f"'{key}' is not a rectangular list of integer expert indices ({e})") from None
    expected = f"[{num_tokens} (or {num_tokens - 1}) tokens, {shape.num_layers} layers, top-{shape.topk}]"
    if (
        experts.dim() != 3
        or experts.shape[0] not in (num_tokens, num_tokens - 1)
        or tuple(experts.shape[1:]) != (shape.num_layers, shape.topk)
    ):
        raise BadRow("routing_mismatch", f"'{key}' has shape {list(experts.shape)}; the model expects "
                     f"{expected} (model.num_layers, model.num_experts_per_tok; one entry per prompt and response "
                     "token)")  # fmt: skip
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= shape.num_experts):
        bad = int(experts.max()) if int(experts.max()) >= shape.num_experts else int(experts.min())
        raise BadRow("routing_mismatch", f"'{key}' names expert {bad}; the model has model.num_experts="
                     f"{shape.num_experts} (indices 0..{shape.num_experts - 1})")  # fmt: skip
    if (experts.sort(dim=-1).values.diff(dim=-1) == 0).any():
        raise BadRow("routing_mismatch", f"'{key}' routes a token to the same expert twice; expected "
                     f"{shape.topk} distinct experts per token and layer")  # fmt: skip
    return experts.to(torch.int32)
