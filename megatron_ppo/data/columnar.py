"""Parquet rows read column-wise: a record batch checked with Arrow and numpy as whole columns and handed to the
prepared dataset's writer as flat arrays, with no Python object per token. Token-id rows are taken as given; text
rows are tokenized a batch at a time (`encoding.encode_texts`: every core, the apart/together check read off the
join's window) and their ids made into the same flat arrays.

`parse.parse_row` is the definition; this reader takes a batch only when every row of it is one that `parse_row`
keeps (`batch_columns` returns None otherwise, and the batch is parsed row by row, naming and counting its bad rows as
ever). A batch is taken when
- the file's schema (`eligible`) has `prompt_ids` and `response_ids` as lists of integers (token-id rows), or the
  prompt and response columns as strings and no id column (text rows, `data.tokenization_check` warn or off, no
  per-token column: their lists are counted without the eos `parse_row` appends); no pair columns; every other column
  it reads of the right type; rows to score or to route (R3) are parsed row by row;
- every row has its prompt and response (ids non-empty and inside the vocabulary, text non-empty with tokens and no
  id the tokenizer's unknown token), either a finite `reward` or `token_rewards` (not both), per-token lists of one
  finite value per response id, behaviour log-probs ≤ 0;
- no row is over a length limit, or the policy is `filter` (those rows are dropped and counted) or `truncate` (cut
  as `rows._fit_length` cuts them, and counted); `error` leaves the batch to the row parser, which names the row.
The rows it gives are `parse_row`'s field for field (the parity test holds it there): `uid` the given one as text,
else the digest of the prompt's ids (before truncation); `data_source` "" when absent; verl's
`reward_model.ground_truth` and `extra_info` as JSON; in warn mode the rows whose ids differ apart and together
counted (filtered rows too, as `rows._count` counts them), the first described (`RowColumns.mismatches`).
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.encoding import encode_texts
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
    Tokenizer,
    apart_vs_together,
    prompt_group,
    prompt_kept,
)

PER_TOKEN = (TOKEN_REWARDS_KEY, BEHAVIOR_LOG_PROBS_KEY)
TOKEN_IDS, TEXT = "token ids", "text"  # the kinds of file `eligible` takes


@dataclass(frozen=True)
class RowColumns:
    """A batch's kept rows column-wise, as `PreparedWriter.add_columns` takes them: `records` the per-row fields,
    `arrays` each token column as (flat values, one length per row); and what reading the batch counts."""

    records: dict[str, list[Any]]
    arrays: dict[str, tuple[np.ndarray, list[int]]]
    tokens: int
    read: int
    filtered_overlong: int = 0
    truncated_prompt: int = 0
    truncated_response: int = 0
    mismatches: list[str] = field(default_factory=list)  # warn mode: "source: how the ids differ", one a row


def _is_list_of(kind: pa.DataType, test) -> bool:
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) and test(kind.value_type)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _is_string(kind: pa.DataType) -> bool:
    return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def eligible(schema: pa.Schema, config: DataConfig, scoring: bool, routing: bool) -> str | None:
    """`TOKEN_IDS` or `TEXT` when a file of this schema may be read column-wise (module docstring), else None."""
    if scoring or routing or ROUTED_EXPERTS_KEY in schema.names:
        return None
    if config.chosen_key in schema.names or config.rejected_key in schema.names:
        return None
    kinds = {name: schema.field(name).type for name in schema.names}
    if all(_is_list_of(kinds.get(key, pa.null()), pa.types.is_integer) for key in (PROMPT_IDS_KEY, RESPONSE_IDS_KEY)):
        kind = TOKEN_IDS
    elif (
        _is_string(kinds.get(config.prompt_key, pa.null()))
        and _is_string(kinds.get(config.response_key, pa.null()))
        and not any(key in kinds for key in (PROMPT_IDS_KEY, RESPONSE_IDS_KEY))
        and config.tokenization_check != "strict"
        and all(pa.types.is_null(kinds.get(key, pa.null())) for key in PER_TOKEN)
    ):
        kind = TEXT
    else:
        return None
    checks = {
        config.reward_key: _is_number,
        TOKEN_REWARDS_KEY: lambda kind: _is_list_of(kind, _is_number),
        BEHAVIOR_LOG_PROBS_KEY: lambda kind: _is_list_of(kind, _is_number),
        UID_KEY: lambda kind: _is_string(kind) or pa.types.is_integer(kind),
        DATA_SOURCE_KEY: _is_string,
        config.response_key: _is_string,
    }
    ok = all(check(kinds[name]) or pa.types.is_null(kinds[name]) for name, check in checks.items() if name in kinds)
    return kind if ok else None


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


@dataclass(frozen=True)
class _Ids:
    """A batch's prompt and response ids, flat, with each row's lengths; the per-token lists (values, lengths,
    given); the warn-mode differences (row, description)."""

    prompt: np.ndarray
    prompt_lengths: np.ndarray
    response: np.ndarray
    response_lengths: np.ndarray
    per_token: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]
    mismatches: list[tuple[int, str]]


def batch_columns(
    batch: pa.RecordBatch, kind: str, first: int, path: str, tokenizer: Tokenizer, config: DataConfig
) -> RowColumns | None:
    """The batch's rows (its first is row `first` of `path`, a file `eligible` called `kind`) column-wise; None when
    a row is not one this reader takes (module docstring)."""
    try:
        reward, given_reward = _rewards(batch, config)
        ids = _token_ids(batch, tokenizer.vocab_size) if kind == TOKEN_IDS else _text_ids(batch, tokenizer, config)
        token_rewarded = ids.per_token[TOKEN_REWARDS_KEY][2]
        if (given_reward == token_rewarded).any():  # neither (a row to score) or both (ambiguous)
            raise _Unclean
        return _kept_columns(batch, first, path, config, ids, reward, given_reward)
    except _Unclean:
        return None


def _rewards(batch: pa.RecordBatch, config: DataConfig) -> tuple[np.ndarray | None, np.ndarray]:
    """(each row's reward as float64, None without the column; whether the row gives one)."""
    column = _column(batch, config.reward_key)
    if column is None:
        return None, np.zeros(batch.num_rows, bool)
    given = column.is_valid().to_numpy(zero_copy_only=False)
    reward = pc.cast(column, pa.float64()).to_numpy(zero_copy_only=False)
    if not np.isfinite(reward[given]).all():
        raise _Unclean
    return reward, given


def _token_ids(batch: pa.RecordBatch, vocab_size: int) -> _Ids:
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
    per_token = {}
    for key in PER_TOKEN:
        column = _column(batch, key)
        if column is None:
            per_token[key] = _no_values(rows)
            continue
        values, lengths = _values(column)
        present = column.is_valid().to_numpy(zero_copy_only=False)
        if (lengths[present] != response_lengths[present]).any() or not np.isfinite(values).all():
            raise _Unclean
        if key == BEHAVIOR_LOG_PROBS_KEY and (values > 0).any():
            raise _Unclean
        per_token[key] = (values, lengths, present)
    return _Ids(prompt, prompt_lengths, response, response_lengths, per_token, [])


def _no_values(rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.zeros(0, np.float64), np.zeros(rows, np.int64), np.zeros(rows, bool)


def _text_ids(batch: pa.RecordBatch, tokenizer: Tokenizer, config: DataConfig) -> _Ids:
    """The texts tokenized in the tokenizer's batch calls; each response's ids then eos, as `parse_row` gives."""
    prompt_column, response_column = _column(batch, config.prompt_key), _column(batch, config.response_key)
    if prompt_column is None or response_column is None or prompt_column.null_count or response_column.null_count:
        raise _Unclean
    prompts, responses = prompt_column.to_pylist(), response_column.to_pylist()
    if not all(responses):
        raise _Unclean
    check = None if config.tokenization_check == "off" else "window"
    encoded = encode_texts(tokenizer, prompts, responses, [check] * len(prompts))
    prompt, prompt_lengths = _flat([encoded.ids[text] for text in prompts])
    response, response_lengths = _flat([encoded.ids[text] for text in responses])
    if (prompt_lengths == 0).any() or (response_lengths == 0).any():
        raise _Unclean
    unk = tokenizer.unk_id
    if unk is not None and ((prompt == unk).any() or (response == unk).any()):
        raise _Unclean  # the row parser names the characters
    mismatches = []
    for row, together in encoded.together.items():
        apart = encoded.ids[prompts[row]] + encoded.ids[responses[row]]
        if (difference := apart_vs_together(apart, together)) is not None:
            mismatches.append((row, difference))
    response = np.insert(response, np.cumsum(response_lengths), tokenizer.eos_id)
    return _Ids(prompt, prompt_lengths, response, response_lengths + 1, {key: _no_values(len(prompts)) for key in
                PER_TOKEN}, mismatches)  # fmt: skip


def _flat(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, lists), np.int64, count=len(lists))
    return np.fromiter(itertools.chain.from_iterable(lists), np.int64, count=int(lengths.sum())), lengths


def _kept_columns(batch: pa.RecordBatch, first: int, path: str, config: DataConfig, ids: _Ids,
                  reward: np.ndarray | None, given_reward: np.ndarray) -> RowColumns:  # fmt: skip
    """The kept rows' columns, over-long rows dropped or cut by `data.overlong_policy`: each row's tokens are its
    prompt's then its response's."""
    rows = batch.num_rows
    max_prompt, max_response = config.max_prompt_length, config.max_response_length
    long_prompt, long_response = ids.prompt_lengths > max_prompt, ids.response_lengths > max_response
    over = long_prompt | long_response
    if over.any() and config.overlong_policy == "error":
        raise _Unclean  # the row parser names the row
    kept = ~over if config.overlong_policy == "filter" else np.ones(rows, bool)
    keep = np.flatnonzero(kept).tolist()
    prompt_ends, response_ends = np.cumsum(ids.prompt_lengths), np.cumsum(ids.response_lengths)
    prompt_starts, response_starts = prompt_ends - ids.prompt_lengths, response_ends - ids.response_lengths
    response_cut = np.minimum(ids.response_lengths, max_response)
    pieces, prompt_lengths = [ids.prompt[:0]], []  # views, copied once by the concatenation
    for i in keep:
        prompt = ids.prompt[prompt_starts[i] : prompt_ends[i]]
        spans = prompt_kept(len(prompt), max_prompt, config.prompt_truncation)
        prompt_lengths.append(sum(span.stop - span.start for span in spans))
        pieces += [prompt[span] for span in spans]
        pieces.append(ids.response[response_starts[i] : response_starts[i] + response_cut[i]])
    lengths = (np.asarray(prompt_lengths, np.int64) + response_cut[kept]).tolist()
    arrays = {"tokens": (np.concatenate(pieces).astype(np.int32, copy=False), lengths)}
    for key, (values, value_lengths, _) in ids.per_token.items():
        value_cut = np.minimum(value_lengths, max_response)
        if not kept.all() or (value_cut != value_lengths).any():
            value_starts = np.cumsum(value_lengths) - value_lengths
            values = np.concatenate([values[value_starts[i] : value_starts[i] + value_cut[i]] for i in keep]
                                    or [values[:0]])  # fmt: skip
        arrays[key] = (values.astype(np.float32, copy=False), value_cut[kept].tolist())
    per_token = ids.per_token
    records = {
        "prompt_length": prompt_lengths,
        "reward": [float(reward[i]) if given_reward[i] else None for i in keep] if reward is not None
        else [None] * len(keep),
        "has_token_rewards": per_token[TOKEN_REWARDS_KEY][2][kept].tolist(),
        "has_behavior_log_probs": per_token[BEHAVIOR_LOG_PROBS_KEY][2][kept].tolist(),
        "uid": _uids(batch, ids.prompt, prompt_starts, prompt_ends, keep),
        "data_source": _strings(batch, DATA_SOURCE_KEY, keep, ""),
        "source": [f"{path}:row {first + i}" for i in keep],
        "ground_truth": _verl_json(batch, keep, ground_truth=True),
        "extra_info": _verl_json(batch, keep, ground_truth=False),
        "routed_tokens": [None] * len(keep),
    }  # fmt: skip
    truncating = config.overlong_policy == "truncate"
    return RowColumns(
        records, arrays, int(sum(lengths)), read=rows, filtered_overlong=int(rows - len(keep)),
        truncated_prompt=int(long_prompt.sum()) if truncating else 0,
        truncated_response=int(long_response.sum()) if truncating else 0,
        mismatches=[f"{path}:row {first + row}: {difference}" for row, difference in ids.mismatches],
    )  # fmt: skip


def _strings(batch: pa.RecordBatch, name: str, keep: list[int], default: str) -> list[str]:
    column = _column(batch, name)
    if column is None:
        return [default] * len(keep)
    values = column.to_pylist()
    return [default if values[i] is None else str(values[i]) for i in keep]


def _uids(batch: pa.RecordBatch, prompt: np.ndarray, starts: np.ndarray, ends: np.ndarray, keep: list[int]):
    """The given `uid` as text, else the prompt's group (`parse.prompt_group`)."""
    column = _column(batch, UID_KEY)
    given = [None] * batch.num_rows if column is None else column.to_pylist()
    out = []
    for i in keep:
        if given[i] is not None:
            out.append(str(given[i]))
        else:
            out.append(prompt_group(prompt[starts[i] : ends[i]]))
    return out


def _verl_json(batch: pa.RecordBatch, keep: list[int], ground_truth: bool) -> list[str | None]:
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
