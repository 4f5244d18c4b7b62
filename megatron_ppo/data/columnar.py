"""Token-id Parquet rows read column-wise: a record batch checked with Arrow and numpy as whole columns and handed
to the prepared dataset's writer as flat arrays, with no Python object per token.

`parse.parse_row` is the definition; this reader takes a batch only when every row of it is one that `parse_row`
keeps as given (`token_id_columns` returns None otherwise, and the batch is parsed row by row, naming and counting
its bad rows as ever). A batch is taken when
- the file's schema has `prompt_ids` and `response_ids` as lists of integers, no pair columns, and every other
  column it reads of the right type (`eligible`); rows to score or to route (R3) are parsed row by row;
- every row has both id lists non-empty and inside the vocabulary, either a finite `reward` or `token_rewards`
  (not both), per-token lists of one finite value per response id, behaviour log-probs ≤ 0;
- no row is over a length limit, or the policy is `filter` (those rows are dropped and counted, as `_fit_length`
  does).
The rows it gives are `parse_row`'s field for field (the parity test holds it there): `uid` the given one as text,
else the digest of the prompt's ids; `data_source` "" when absent; verl's `reward_model.ground_truth` and
`extra_info` as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.parse import (
    BEHAVIOR_LOG_PROBS_KEY,
    DATA_SOURCE_KEY,
    EXTRA_INFO_KEY,
    GROUND_TRUTH_KEY,
    PROMPT_IDS_KEY,
    RESPONSE_IDS_KEY,
    REWARD_MODEL_KEY,
    ROUTED_EXPERTS_KEY,
    TOKEN_REWARDS_KEY,
    UID_KEY,
    prompt_group,
)

PER_TOKEN = (TOKEN_REWARDS_KEY, BEHAVIOR_LOG_PROBS_KEY)


@dataclass(frozen=True)
class RowColumns:
    """Rows column-wise, as `PreparedWriter.add_columns` takes them: `records` the per-row fields, `arrays` each
    token column as (flat values, one length per row)."""

    records: dict[str, list[Any]]
    arrays: dict[str, tuple[np.ndarray, list[int]]]
    tokens: int


def _is_list_of(kind: pa.DataType, test) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and test(kind.value_type)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def eligible(schema: pa.Schema, config: DataConfig, scoring: bool, routing: bool) -> bool:
    """Whether a file of this schema may be read column-wise (module docstring)."""
    if scoring or routing or ROUTED_EXPERTS_KEY in schema.names:
        return False
    if config.chosen_key in schema.names or config.rejected_key in schema.names:
        return False
    kinds = {name: schema.field(name).type for name in schema.names}
    if not all(
        _is_list_of(kinds.get(key, pa.null()), pa.types.is_integer) for key in (PROMPT_IDS_KEY, RESPONSE_IDS_KEY)
    ):
        return False
    checks = {
        config.reward_key: _is_number,
        TOKEN_REWARDS_KEY: lambda kind: _is_list_of(kind, _is_number),
        BEHAVIOR_LOG_PROBS_KEY: lambda kind: _is_list_of(kind, _is_number),
        UID_KEY: lambda kind: pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_integer(kind),
        DATA_SOURCE_KEY: lambda kind: pa.types.is_string(kind) or pa.types.is_large_string(kind),
        config.response_key: lambda kind: pa.types.is_string(kind) or pa.types.is_large_string(kind),
    }
    return all(check(kinds[name]) or pa.types.is_null(kinds[name]) for name, check in checks.items() if name in kinds)


def _column(batch: pa.RecordBatch, name: str) -> pa.Array | None:
    index = batch.schema.get_field_index(name)
    column = None if index < 0 else batch.column(index)
    return None if column is None or column.null_count == len(column) else column


def _values(column: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(the non-null lists' values concatenated, in the column's own type; each row's length, null lists as 0)."""
    lengths = column.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    flat = column.flatten()
    if flat.null_count:
        raise _Unclean
    return flat.to_numpy(zero_copy_only=False), lengths


class _Unclean(Exception):
    """A row of the batch is not one this reader takes: the batch is parsed row by row."""


def token_id_columns(
    batch: pa.RecordBatch, first: int, path: str, vocab_size: int, config: DataConfig
) -> tuple[RowColumns, int] | None:
    """The batch's rows (its first is row `first` of `path`) column-wise and the number of over-long rows it
    dropped; None when a row is not one this reader takes (module docstring)."""
    try:
        return _columns(batch, first, path, vocab_size, config)
    except _Unclean:
        return None


def _columns(batch: pa.RecordBatch, first: int, path: str, vocab_size: int, config: DataConfig):
    rows = batch.num_rows
    prompt_column, response_column = _column(batch, PROMPT_IDS_KEY), _column(batch, RESPONSE_IDS_KEY)
    if prompt_column is None or response_column is None or prompt_column.null_count or response_column.null_count:
        raise _Unclean
    prompt, prompt_lengths = _values(prompt_column)
    response, response_lengths = _values(response_column)
    if (prompt_lengths == 0).any() or (response_lengths == 0).any():
        raise _Unclean
    if len(prompt) and (prompt.min() < 0 or prompt.max() >= vocab_size):
        raise _Unclean
    if len(response) and (response.min() < 0 or response.max() >= vocab_size):
        raise _Unclean
    reward_column = _column(batch, config.reward_key)
    given_reward = np.zeros(rows, bool) if reward_column is None else reward_column.is_valid().to_numpy(False)
    per_token = {}
    for key in PER_TOKEN:
        column = _column(batch, key)
        if column is None:
            per_token[key] = (np.zeros(0, np.float64), np.zeros(rows, np.int64), np.zeros(rows, bool))
            continue
        values, lengths = _values(column)
        present = column.is_valid().to_numpy(zero_copy_only=False)
        if (lengths[present] != response_lengths[present]).any() or not np.isfinite(values).all():
            raise _Unclean
        if key == BEHAVIOR_LOG_PROBS_KEY and (values > 0).any():
            raise _Unclean
        per_token[key] = (values, lengths, present)
    token_rewarded = per_token[TOKEN_REWARDS_KEY][2]
    if (given_reward == token_rewarded).any():  # neither (a row to score) or both (ambiguous)
        raise _Unclean
    reward = None
    if reward_column is not None:
        reward = pc.cast(reward_column, pa.float64()).to_numpy(zero_copy_only=False)
        if not np.isfinite(reward[given_reward]).all():
            raise _Unclean
    kept = (prompt_lengths <= config.max_prompt_length) & (response_lengths <= config.max_response_length)
    if not kept.all() and config.overlong_policy != "filter":
        raise _Unclean
    return _kept_columns(batch, first, path, kept, prompt, prompt_lengths, response, response_lengths, reward,
                         given_reward, per_token), int(rows - kept.sum())  # fmt: skip


def _kept_columns(batch, first, path, kept, prompt, prompt_lengths, response, response_lengths, reward, given_reward,
                  per_token) -> RowColumns:  # fmt: skip
    """The kept rows' columns: each row's tokens are its prompt's then its response's."""
    prompt_ends, response_ends = np.cumsum(prompt_lengths), np.cumsum(response_lengths)
    prompt_starts, response_starts = prompt_ends - prompt_lengths, response_ends - response_lengths
    lengths = prompt_lengths + response_lengths
    keep = np.flatnonzero(kept)
    bounds = zip(*(a[kept].tolist() for a in (prompt_starts, prompt_ends, response_starts, response_ends)), strict=True)
    pieces = [prompt[:0]]  # each kept row's prompt then its response: views, copied once by the concatenation
    for p0, p1, r0, r1 in bounds:
        pieces += (prompt[p0:p1], response[r0:r1])
    arrays = {"tokens": (np.concatenate(pieces).astype(np.int32, copy=False), lengths[kept].tolist())}
    for key, (values, value_lengths, _) in per_token.items():
        if not kept.all():
            value_ends = np.cumsum(value_lengths)
            values = np.concatenate([values[value_ends[i] - value_lengths[i] : value_ends[i]] for i in keep.tolist()]
                                    or [values[:0]])  # fmt: skip
        arrays[key] = (values.astype(np.float32, copy=False), value_lengths[kept].tolist())
    uids = _uids(batch, prompt, prompt_starts, prompt_ends, kept)
    records = {
        "prompt_length": prompt_lengths[kept].tolist(),
        "reward": [float(reward[i]) if given_reward[i] else None for i in keep] if reward is not None
        else [None] * len(keep),
        "has_token_rewards": per_token[TOKEN_REWARDS_KEY][2][kept].tolist(),
        "has_behavior_log_probs": per_token[BEHAVIOR_LOG_PROBS_KEY][2][kept].tolist(),
        "uid": uids,
        "data_source": _strings(batch, DATA_SOURCE_KEY, keep, ""),
        "source": [f"{path}:row {first + i}" for i in keep],
        "ground_truth": _verl_json(batch, keep, ground_truth=True),
        "extra_info": _verl_json(batch, keep, ground_truth=False),
        "routed_tokens": [None] * len(keep),
    }  # fmt: skip
    return RowColumns(records, arrays, int(lengths[kept].sum()))


def _strings(batch: pa.RecordBatch, name: str, keep: np.ndarray, default: str) -> list[str]:
    column = _column(batch, name)
    if column is None:
        return [default] * len(keep)
    values = column.to_pylist()
    return [default if values[i] is None else str(values[i]) for i in keep]


def _uids(batch: pa.RecordBatch, prompt: np.ndarray, starts: np.ndarray, ends: np.ndarray, kept: np.ndarray):
    """The given `uid` as text, else the prompt's group (`parse.prompt_group`)."""
    column = _column(batch, UID_KEY)
    given = [None] * batch.num_rows if column is None else column.to_pylist()
    out = []
    for i in np.flatnonzero(kept):
        if given[i] is not None:
            out.append(str(given[i]))
        else:
            out.append(prompt_group(prompt[starts[i] : ends[i]]))
    return out


def _verl_json(batch: pa.RecordBatch, keep: np.ndarray, ground_truth: bool) -> list[str | None]:
    """verl's `reward_model.ground_truth` (or `extra_info`, when an object) of each kept row, as JSON."""
    column = _column(batch, REWARD_MODEL_KEY if ground_truth else EXTRA_INFO_KEY)
    if column is None:
        return [None] * len(keep)
    values = column.to_pylist()
    out = []
    for i in keep:
        value = values[i]
        if ground_truth:
            value = value.get(GROUND_TRUTH_KEY) if isinstance(value, dict) else None
        elif not isinstance(value, dict):
            value = None
        out.append(None if value is None else json.dumps(value))
    return out
