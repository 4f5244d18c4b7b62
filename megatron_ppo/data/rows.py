"""Read the offline dataset — rows of (prompt, response, reward) — into token ids, checking every row.

A row is one JSON object per line (JSONL) or one Parquet record, with the columns
    prompt              a string, or a list of chat messages {"role": str, "content": str} (see `render_chat`)
    response            a non-empty string
    reward              a finite number, the sequence score — or instead
    token_rewards       finite numbers, one per response token
    behavior_log_probs  optional: log-probs ≤ 0 of the behaviour policy, one per response token
    uid                 optional: GRPO group id (string or integer); default: the row's source "path:line"
    data_source         optional: a string; default ""
The prompt/response/reward names come from `DataConfig.*_key`; other columns are ignored, a null counts as absent,
and blank JSONL lines are not rows. Response ids end with the tokenizer's eos; the per-token lists get a 0.0 there.

A bad row raises `DataError` naming its "path:line" (data.on_bad_row=error), or is written with its reason to the
rejects file and counted (skip). Over-long rows are dropped or truncated (data.overlong_policy) and counted:
nothing is left out without a number in the `DataReport`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_ppo.config.schema import DataConfig

TOKEN_REWARDS_KEY = "token_rewards"
BEHAVIOR_LOG_PROBS_KEY = "behavior_log_probs"
UID_KEY = "uid"
DATA_SOURCE_KEY = "data_source"
_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
_OPTIONS = {
    "format": ("auto", "jsonl", "parquet"),
    "overlong_policy": ("filter", "truncate"),
    "on_bad_row": ("error", "skip"),
}


class Tokenizer(Protocol):
    """What the reader needs of a tokenizer: text → ids, and the id appended after every response."""

    eos_id: int

    def encode(self, text: str) -> list[int]: ...


@dataclass(frozen=True)
class Row:
    """One kept row in token ids. The per-token lists, when present, have one entry per `response_ids` entry."""

    prompt_ids: list[int]
    response_ids: list[int]  # the response's tokens then eos (the eos may be cut by truncation)
    reward: float | None  # sequence score; None when token_rewards are given
    token_rewards: list[float] | None
    behavior_log_probs: list[float] | None
    uid: str
    data_source: str
    source: str  # "path:line" (JSONL, 1-based) or "path:row N" (Parquet, 0-based)


@dataclass
class DataReport:
    """What reading did: rows_read = rows_kept + rejected + filtered_overlong; truncations are of kept rows."""

    rows_read: int = 0
    rows_kept: int = 0
    rejected: int = 0
    filtered_overlong: int = 0
    truncated_prompt: int = 0
    truncated_response: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # rejection kind → count
    rejects_path: str | None = None

    def summary(self) -> str:
        """One line for the log."""
        rejected = f"rejected {self.rejected}"
        if self.reasons:
            kinds = ", ".join(f"{kind}={count}" for kind, count in sorted(self.reasons.items()))
            rejected += f" ({kinds}; see {self.rejects_path})"
        return (
            f"data: read {self.rows_read} rows, kept {self.rows_kept}, {rejected}, "
            f"filtered {self.filtered_overlong} over-long, truncated {self.truncated_prompt} prompts "
            f"and {self.truncated_response} responses"
        )


class DataError(ValueError):
    """A dataset problem; the message names the file (and line) and says what was expected."""


class _BadRow(Exception):
    """A row that fails validation: `kind` is the counted category, `problem` the readable explanation."""

    def __init__(self, kind: str, problem: str) -> None:
        super().__init__(problem)
        self.kind, self.problem = kind, problem


def render_chat(messages: list[dict[str, str]]) -> str:
    """Chat messages → prompt text: "<|{role}|>\\n{content}\\n" per message, then "<|assistant|>\\n".

    A fixed, model-agnostic template; to use a model's own chat template, render the prompts to strings upstream.
    """
    return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages) + "<|assistant|>\n"


def read_rows(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    config: DataConfig,
    rejects_path: str | Path | None = None,
) -> tuple[list[Row], DataReport]:
    """Read, check, tokenize and length-limit every row of `paths`, in order. See the module docstring.

    `rejects_path` is required when `config.on_bad_row == "skip"`; it is overwritten with one JSON line
    {"source", "kind", "reason", "row"} per rejected row ("row": the object, or the raw line if it did not parse).
    Raises `DataError` for a missing or unreadable file, for the first bad row in error mode, and when no row is left.
    """
    _check_options(config)
    if not paths:
        raise DataError("no data files given; set data.train_files (or data.val_files)")
    files = [(Path(p), _format_of(Path(p), config.format)) for p in paths]
    report = DataReport()
    rejects: IO[str] | None = None
    if config.on_bad_row == "skip":
        if rejects_path is None:
            raise DataError("data.on_bad_row=skip needs a rejects file path to write the rejected rows to")
        report.rejects_path = str(rejects_path)
        rejects = _open_rejects(Path(rejects_path))
    rows: list[Row] = []
    try:
        for path, fmt in files:
            records = _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path)
            for source, raw in records:
                report.rows_read += 1
                record = raw
                try:
                    if isinstance(raw, bytes):
                        record = _decode_json(raw)
                    row = _parse_row(record, source, tokenizer, config)
                except _BadRow as bad:
                    if rejects is None:
                        raise DataError(f"{source}: {bad.problem}") from None
                    report.rejected += 1
                    report.reasons[bad.kind] = report.reasons.get(bad.kind, 0) + 1
                    shown = record.decode("utf-8", "replace").rstrip("\r\n") if isinstance(record, bytes) else record
                    entry = {"source": source, "kind": bad.kind, "reason": bad.problem, "row": shown}
                    rejects.write(json.dumps(entry, default=str) + "\n")
                    continue
                fitted = _fit_length(row, config, report)
                if fitted is not None:
                    rows.append(fitted)
    finally:
        if rejects is not None:
            rejects.close()
    report.rows_kept = len(rows)
    if not rows:
        names = ", ".join(str(p) for p, _ in files)
        raise DataError(f"no rows left in {names}: {report.summary()}")
    return rows, report


def _check_options(config: DataConfig) -> None:
    for name, allowed in _OPTIONS.items():
        value = getattr(config, name)
        if value not in allowed:
            raise ValueError(f"data.{name}={value!r}; expected one of {', '.join(allowed)}")


def _format_of(path: Path, fmt: str) -> str:
    if not path.is_file():
        raise DataError(f"data file {path} does not exist (or is not a file)")
    if fmt != "auto":
        return fmt
    if path.suffix.lower() not in _EXTENSIONS:
        raise DataError(
            f"cannot tell the format of {path} from its extension; expected .jsonl, .json or .parquet, "
            "or set data.format=jsonl|parquet"
        )
    return _EXTENSIONS[path.suffix.lower()]


def _open_rejects(path: Path) -> IO[str]:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("w", encoding="utf-8")


def _jsonl_records(path: Path) -> Iterator[tuple[str, bytes]]:
    """(source, raw line) for every non-blank line; lines are split on b"\\n" only."""
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield f"{path}:{number}", line


def _parquet_records(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        records = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as Parquet ({e})") from e
    for number, record in enumerate(records):
        yield f"{path}:row {number}", record


def _decode_json(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise _BadRow("invalid_json", f"the line is not UTF-8 text ({e}); expected one JSON object per line") from e
    except json.JSONDecodeError as e:
        raise _BadRow(
            "invalid_json", f"the line is not valid JSON ({e.msg} at character {e.pos + 1}); expected one JSON object"
        ) from e


def _parse_row(record: Any, source: str, tokenizer: Tokenizer, config: DataConfig) -> Row:
    if not isinstance(record, dict):
        raise _BadRow(
            "not_object",
            f"the row is {_describe(record)}; expected an object with keys such as "
            f"'{config.prompt_key}', '{config.response_key}', '{config.reward_key}'",
        )
    prompt = _prompt_text(_required(record, config.prompt_key), config.prompt_key)
    response = _required(record, config.response_key)
    if not isinstance(response, str):
        raise _BadRow("wrong_type", f"'{config.response_key}' is {_describe(response)}; expected a string")
    reward, token_rewards = record.get(config.reward_key), record.get(TOKEN_REWARDS_KEY)
    if reward is None and token_rewards is None:
        raise _BadRow(
            "missing_reward",
            f"neither '{config.reward_key}' nor '{TOKEN_REWARDS_KEY}' is given; expected a sequence reward (a number) "
            "or a list of per-token rewards",
        )
    if reward is not None and token_rewards is not None:
        raise _BadRow(
            "ambiguous_reward",
            f"both '{config.reward_key}' and '{TOKEN_REWARDS_KEY}' are given; expected exactly one of them",
        )
    if reward is not None:
        reward = _finite_number(reward, f"'{config.reward_key}'")
    response_tokens = tokenizer.encode(response) if response else []
    if not response_tokens:
        raise _BadRow(
            "empty_response",
            f"'{config.response_key}' ({_describe(response)}) has no tokens; expected a non-empty response",
        )
    prompt_ids = tokenizer.encode(prompt)
    if not prompt_ids:
        raise _BadRow(
            "empty_prompt",
            f"'{config.prompt_key}' has no tokens; expected a non-empty prompt (the first "
            "response token is predicted from it)",
        )
    n = len(response_tokens)
    token_rewards = _per_token(record, TOKEN_REWARDS_KEY, n)
    behavior_log_probs = _per_token(record, BEHAVIOR_LOG_PROBS_KEY, n)
    if behavior_log_probs is not None:
        positive = next((i for i, lp in enumerate(behavior_log_probs) if lp > 0), None)
        if positive is not None:
            raise _BadRow(
                "positive_log_prob",
                f"'{BEHAVIOR_LOG_PROBS_KEY}'[{positive}] = {behavior_log_probs[positive]} is > 0; expected "
                "log-probabilities ≤ 0",
            )
    return Row(
        prompt_ids=prompt_ids,
        response_ids=[*response_tokens, tokenizer.eos_id],
        reward=reward,
        token_rewards=None if token_rewards is None else [*token_rewards, 0.0],
        behavior_log_probs=None if behavior_log_probs is None else [*behavior_log_probs, 0.0],
        uid=_uid(record.get(UID_KEY), source),
        data_source=_data_source(record.get(DATA_SOURCE_KEY)),
        source=source,
    )


def _required(record: dict[str, Any], key: str) -> Any:
    value = record.get(key)
    if value is None:
        present = ", ".join(f"'{k}'" for k in list(record)[:8]) or "none"
        raise _BadRow("missing_field", f"'{key}' is missing (keys present: {present}); expected a '{key}' column")
    return value


def _prompt_text(prompt: Any, key: str) -> str:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise _BadRow(
            "wrong_type",
            f"'{key}' is {_describe(prompt)}; expected a string or a non-empty list of chat "
            "messages {'role': str, 'content': str}",
        )
    for i, message in enumerate(prompt):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise _BadRow(
                "wrong_type",
                f"'{key}' message {i} is {_describe(message)}; expected a chat message {{'role': str, 'content': str}}",
            )
    return render_chat(prompt)


def _finite_number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _BadRow("wrong_type", f"{what} is {_describe(value)}; expected a number")
    if not math.isfinite(value):
        raise _BadRow("non_finite", f"{what} is {value}; expected a finite number")
    return float(value)


def _per_token(record: dict[str, Any], key: str, num_tokens: int) -> list[float] | None:
    """A per-response-token list of finite numbers, one per token before eos; None when absent."""
    values = record.get(key)
    if values is None:
        return None
    if not isinstance(values, list):
        raise _BadRow(
            "wrong_type",
            f"'{key}' is {_describe(values)}; expected a list of {num_tokens} numbers, one per response token",
        )
    if len(values) != num_tokens:
        raise _BadRow(
            "length_mismatch",
            f"'{key}' has {len(values)} entries but the response has {num_tokens} "
            f"tokens; expected {num_tokens}, one per response token (eos not included)",
        )
    return [_finite_number(v, f"'{key}'[{i}]") for i, v in enumerate(values)]


def _uid(uid: Any, source: str) -> str:
    if uid is None:
        return source
    if isinstance(uid, bool) or not isinstance(uid, str | int):
        raise _BadRow("wrong_type", f"'{UID_KEY}' is {_describe(uid)}; expected a string or an integer group id")
    return str(uid)


def _data_source(data_source: Any) -> str:
    if data_source is None:
        return ""
    if not isinstance(data_source, str):
        raise _BadRow("wrong_type", f"'{DATA_SOURCE_KEY}' is {_describe(data_source)}; expected a string")
    return data_source


def _describe(value: Any) -> str:
    """A value as a user wrote it: its JSON type and a short excerpt."""
    kind = {bool: "a boolean", str: "a string", list: "a list", dict: "an object", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, int | float) else f"a {type(value).__name__}"
    )
    text = json.dumps(value, default=str)
    return f"{kind} {text[:57] + '...' if len(text) > 60 else text}"


def _fit_length(row: Row, config: DataConfig, report: DataReport) -> Row | None:
    """Apply data.max_prompt_length / max_response_length (eos included): drop (filter) or cut (truncate) the row.

    Truncation keeps the last prompt tokens and the first response tokens, cutting the per-token lists alike."""
    max_prompt, max_response = config.max_prompt_length, config.max_response_length
    long_prompt, long_response = len(row.prompt_ids) > max_prompt, len(row.response_ids) > max_response
    if not (long_prompt or long_response):
        return row
    if config.overlong_policy == "filter":
        report.filtered_overlong += 1
        return None
    report.truncated_prompt += long_prompt
    report.truncated_response += long_response
    return dataclasses.replace(
        row,
        prompt_ids=row.prompt_ids[len(row.prompt_ids) - max_prompt :] if long_prompt else row.prompt_ids,
        response_ids=row.response_ids[:max_response],
        token_rewards=None if row.token_rewards is None else row.token_rewards[:max_response],
        behavior_log_probs=None if row.behavior_log_probs is None else row.behavior_log_probs[:max_response],
    )
