"""Read the offline dataset — JSONL lines or Parquet rows of (prompt, response, reward) — into `Row`s of token ids.

What a row may hold and how it is checked is in `parse.py`; a preference pair is two rows (`pairs.py`). A bad row
raises `DataError` naming its "path:line" (data.on_bad_row=error), or is written with its reason to the rejects file
and counted (skip). Over-long rows are
dropped or truncated (data.overlong_policy) and counted, or refused (error): nothing is left out without a number in
the `DataReport`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import math
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_ppo.config.errors import UserError
from megatron_ppo.config.fields import field_problems
from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.chat import BUILTIN_FORMAT
from megatron_ppo.data.columnar import RowColumns, batch_columns, eligible
from megatron_ppo.data.encoding import BatchEncoded
from megatron_ppo.data.pairs import expand_records, of_side
from megatron_ppo.data.parse import ParsedRow, Row, Tokenizer, parse_row, prompt_kept
from megatron_ppo.data.scoring import Scorer
from megatron_ppo.data.values import BadRow, RoutingShape

__all__ = ["DataError", "DataReport", "Row", "Tokenizer", "read_rows", "stream_rows"]

# The Parquet metadata key under which `megatron-ppo score` names the reward model that scored a file (JSON: its
# "reward_model" path, "checkpoint_hash", "source" file, ...); read back into `DataReport.scored_by`.
SCORED_BY_KEY = b"megatron_ppo.scored_by"
_EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}
RECORDS_PER_CHUNK = 1024  # records decoded and batch-tokenized together
BATCHES_IN_FLIGHT = 2  # Parquet batches read column-wise at once (`_columnar_rows`)


@dataclass
class DataReport:
    """What reading did: rows_read = rows_kept + rejected + filtered_overlong; truncations are of kept rows.
    Of the kept and filtered rows: `scored` got their reward from `scorer`, `builtin_chat_prompts` had chat prompts
    rendered in the built-in format, `tokenization_mismatches` tokenize differently apart than together (warn)."""

    rows_read: int = 0
    rows_kept: int = 0
    rejected: int = 0
    filtered_overlong: int = 0
    truncated_prompt: int = 0
    truncated_response: int = 0
    reasons: dict[str, int] = field(default_factory=dict)  # rejection kind → count
    rejects_path: str | None = None
    scored: int = 0
    scorer: str | None = None
    builtin_chat_prompts: int = 0
    tokenization_mismatches: int = 0
    first_mismatch: str | None = None  # "path:line: what differs"
    scored_by: dict[str, dict[str, Any]] = field(default_factory=dict)  # file → the reward model that scored it
    unknown_characters: int = 0  # kept rows with text outside the tokenizer's vocabulary (the unknown token)
    first_unknown: str | None = None  # "path:line: which characters"

    def summary(self) -> str:
        """One line for the log."""
        rejected = f"rejected {self.rejected}"
        if self.reasons:
            kinds = ", ".join(f"{kind}={count}" for kind, count in sorted(self.reasons.items()))
            rejected += f" ({kinds}; see {self.rejects_path})"
        line = (
            f"data: read {self.rows_read} rows, kept {self.rows_kept}, {rejected}, "
            f"filtered {self.filtered_overlong} over-long, truncated {self.truncated_prompt} prompts "
            f"and {self.truncated_response} responses"
        )
        if self.scored:
            line += f"; scored {self.scored} rows with {self.scorer}"
        for path, info in self.scored_by.items():
            line += f"; {path} scored by the reward model {info.get('reward_model')} ({info.get('checkpoint_hash')})"
        if self.builtin_chat_prompts:
            line += (
                f"; {self.builtin_chat_prompts} chat prompts rendered in the built-in {BUILTIN_FORMAT} format "
                "(the tokenizer has no chat_template)"
            )
        if self.tokenization_mismatches:
            line += (
                f"; {self.tokenization_mismatches} rows tokenize differently apart than together, kept with the ids "
                f"apart (data.tokenization_check=warn; first: {self.first_mismatch})"
            )
        if self.unknown_characters:
            line += (
                f"; {self.unknown_characters} rows hold characters outside the tokenizer's vocabulary, trained on as "
                f"its unknown token (data.tokenization_check=strict refuses them; first: {self.first_unknown})"
            )
        return line


class DataError(UserError, ValueError):
    """A dataset problem; the message names the file (and line) and says what was expected."""


def read_rows(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    config: DataConfig,
    rejects_path: str | Path | None = None,
    scorer: Scorer | None = None,
    routing: RoutingShape | None = None,
) -> tuple[list[Row], DataReport]:
    """Read, check, tokenize, score and length-limit every row of `paths`, in order. See the module docstring.

    `rejects_path` is required when `config.on_bad_row == "skip"`; it is overwritten with one JSON line
    {"source", "kind", "reason", "row"} per rejected row ("row": the object, or the raw line if it did not parse).
    `scorer` (from `scoring.build_scorer(config.reward)`) gives the reward of rows that carry none; a row it cannot
    score is rejected with the reason. `routing` (actor.router_replay.mode=R3): every row's `routed_experts` is read
    and checked against the model's layers, top-k and experts.
    Raises `DataError` for a missing or unreadable file, for the first bad row in error mode, and when no row is left.
    """
    report = DataReport(scorer=None if scorer is None else scorer.name)
    rows = list(stream_rows(paths, tokenizer, config, report, rejects_path, scorer, routing))
    return rows, report


def stream_rows(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    config: DataConfig,
    report: DataReport,
    rejects_path: str | Path | None = None,
    scorer: Scorer | None = None,
    routing: RoutingShape | None = None,
    columnar: bool = False,
) -> Iterator[Row | RowColumns]:
    """The kept rows of `read_rows`, one at a time, counting into `report` as they come (what the prepared dataset
    writes without holding them; `read_rows` for the rest). Text is tokenized a chunk of records at a time with the
    tokenizer's batch call (`BatchEncoded`: every core); each row is still parsed on its own (`parse_row`).
    `columnar`: a Parquet batch of token-id or text rows that `columnar.py` takes whole comes as one `RowColumns`."""
    _check_options(config)
    if not paths:
        raise DataError("no data files given; set data.train_files")
    files = [(Path(p), format_of(Path(p), config.format)) for p in paths]
    rejects: IO[str] | None = None
    if config.on_bad_row == "skip":
        if rejects_path is None:
            raise DataError("data.on_bad_row=skip needs a rejects file path to write the rejected rows to")
        report.rejects_path = str(rejects_path)
        rejects = _open_rejects(Path(rejects_path))
    parser = _RowParser(BatchEncoded(tokenizer, config), config, report, rejects, scorer, routing)
    try:
        for path, fmt in files:
            if fmt == "parquet" and (scorer_of_file := scored_by(path)) is not None:
                report.scored_by[str(path)] = scorer_of_file
            kind = (
                columnar
                and fmt == "parquet"
                and eligible(_schema(path), config, scorer is not None, routing is not None)
            )
            if kind:
                yield from _columnar_rows(path, kind, tokenizer, config, report, parser)
                continue
            for chunk in _chunks(records_of(path, fmt), RECORDS_PER_CHUNK):
                yield from parser.rows(chunk)
    finally:
        if rejects is not None:
            rejects.close()
    if not report.rows_kept:
        names = ", ".join(str(p) for p, _ in files)
        raise DataError(f"no rows left in {names}: {report.summary()}")


def _columnar_rows(path: Path, kind: str, tokenizer: Tokenizer, config: DataConfig, report: DataReport,
                   parser: _RowParser) -> Iterator[Row | RowColumns]:  # fmt: skip
    """A Parquet file (`kind` of rows, `columnar.eligible`) a batch at a time: column-wise where `batch_columns`
    takes the batch, row by row (`parser`) where it does not. `BATCHES_IN_FLIGHT` batches are read at once on
    threads: while one holds the interpreter, the tokenizer encodes another (it lets the interpreter go)."""
    batches = _numbered(_parquet_batches(path))

    def columns(numbered: tuple[int, pa.RecordBatch]) -> tuple[int, pa.RecordBatch, RowColumns | None]:
        first, batch = numbered
        return first, batch, batch_columns(batch, kind, first, str(path), tokenizer, config)

    with ThreadPoolExecutor(BATCHES_IN_FLIGHT) as pool:
        pending = collections.deque(pool.submit(columns, b) for b in itertools.islice(batches, BATCHES_IN_FLIGHT))
        while pending:
            first, batch, taken = pending.popleft().result()
            pending.extend(pool.submit(columns, b) for b in itertools.islice(batches, 1))
            if taken is None:
                yield from parser.rows([(f"{path}:row {first + i}", r) for i, r in enumerate(batch.to_pylist())])
            else:
                _count_columns(taken, report)
                yield taken


def _numbered(batches: Iterator[pa.RecordBatch]) -> Iterator[tuple[int, pa.RecordBatch]]:
    """Each batch with the index of its first row in the file."""
    first = 0
    for batch in batches:
        yield first, batch
        first += batch.num_rows


def _count_columns(columns: RowColumns, report: DataReport) -> None:
    kept = len(columns.records["source"])
    report.rows_read += columns.read
    report.rows_kept += kept
    report.filtered_overlong += columns.filtered_overlong
    report.truncated_prompt += columns.truncated_prompt
    report.truncated_response += columns.truncated_response
    report.tokenization_mismatches += len(columns.mismatches)
    if columns.mismatches and report.first_mismatch is None:
        report.first_mismatch = columns.mismatches[0]


class _RowParser:
    """Records parsed one by one (`parse_row`), a chunk's text tokenized in one batch call first; bad ones named
    (error mode) or written to the rejects file (skip), everything counted into the report."""

    def __init__(self, encoded: BatchEncoded, config: DataConfig, report: DataReport, rejects: IO[str] | None,
                 scorer: Scorer | None, routing: RoutingShape | None) -> None:  # fmt: skip
        self.encoded, self.config, self.report, self.rejects = encoded, config, report, rejects
        self.scorer, self.routing = scorer, routing

    def rows(self, chunk: list[tuple[str, Any]]) -> Iterator[Row]:
        config, report = self.config, self.report
        expanded = [(source, raw, _expanded(raw, source, config)) for source, raw in chunk]
        self.encoded.encode_ahead(one for _, _, pairs in expanded if not isinstance(pairs, BadRow)
                                  for _, one in pairs)  # fmt: skip
        for source, raw, pairs in expanded:
            report.rows_read += 1  # a pair read is two rows, once both are kept
            try:
                if isinstance(pairs, BadRow):
                    raise pairs
                parsed_rows = []  # a preference pair is two rows: rejected together when either is bad
                for where, one in pairs:
                    try:
                        parsed_rows.append(parse_row(one, where, self.encoded, config, self.scorer, self.routing))
                    except BadRow as bad:
                        raise of_side(bad, where, source) from None
            except BadRow as bad:
                if self.rejects is None:
                    raise DataError(f"{source}: {bad.problem}") from None
                _reject(self.rejects, report, bad, source, raw)
                continue
            report.rows_read += len(parsed_rows) - 1
            for parsed in parsed_rows:
                _count(parsed, report)
                fitted = _fit_length(parsed.row, config, report)
                if fitted is not None:
                    report.rows_kept += 1
                    yield fitted
        self.encoded.forget()


def _expanded(raw: Any, source: str, config: DataConfig) -> list[tuple[str, Any]] | BadRow:
    """The record(s) of one JSONL line or Parquet row (a preference pair is two), or why it is not one."""
    try:
        record = decode_json_line(raw) if isinstance(raw, bytes) else raw
        return expand_records(record, source, config)
    except BadRow as bad:
        return bad


def _reject(rejects: IO[str], report: DataReport, bad: BadRow, source: str, raw: Any) -> None:
    """One rejected record, counted by kind and written with its reason (skip mode)."""
    report.rejected += 1
    report.reasons[bad.kind] = report.reasons.get(bad.kind, 0) + 1
    if isinstance(raw, bytes):
        try:
            raw = decode_json_line(raw)
        except BadRow:
            raw = raw.decode("utf-8", "replace").rstrip("\r\n")
    entry = {"source": source, "kind": bad.kind, "reason": bad.problem, "row": _json_safe(raw)}
    rejects.write(json.dumps(entry, default=str, allow_nan=False) + "\n")


def _chunks(items: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _count(parsed: ParsedRow, report: DataReport) -> None:
    report.scored += parsed.scored
    report.builtin_chat_prompts += parsed.builtin_chat
    if parsed.mismatch is not None:
        report.tokenization_mismatches += 1
        if report.first_mismatch is None:
            report.first_mismatch = f"{parsed.row.source}: {parsed.mismatch}"
    if parsed.unknown is not None:
        report.unknown_characters += 1
        if report.first_unknown is None:
            report.first_unknown = f"{parsed.row.source}: {parsed.unknown}"


def _check_options(config: DataConfig) -> None:
    """The schema's rules for the `data` section (a caller may pass a config it did not validate)."""
    if problems := field_problems(config, "data."):
        raise ValueError("; ".join(problems))


def format_of(path: Path, fmt: str) -> str:
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


def records_of(path: Path, fmt: str) -> Iterator[tuple[str, Any]]:
    """(source "path:line" / "path:row N", record) for each row of a data file in `fmt` (`format_of`): a JSONL line
    as its raw bytes (`decode_json_line`), a Parquet row as its dict."""
    return _jsonl_records(path) if fmt == "jsonl" else _parquet_records(path)


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
    """(source, row as a dict) for every row, a record batch at a time (the file is never held whole)."""
    number = 0
    for batch in _parquet_batches(path):
        for record in batch.to_pylist():
            yield f"{path}:row {number}", record
            number += 1


def _parquet_batches(path: Path) -> Iterator[pa.RecordBatch]:
    try:
        yield from pq.ParquetFile(path).iter_batches(batch_size=RECORDS_PER_CHUNK)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as Parquet ({e})") from e


def _schema(path: Path) -> pa.Schema:
    try:
        return pq.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: cannot read it as Parquet ({e})") from e


def scored_by(path: str | Path) -> dict[str, Any] | None:
    """What `megatron-ppo score` wrote into a Parquet file's metadata about the reward model that scored it; None for
    a file it did not write (or not Parquet)."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError):
        return None
    return json.loads(metadata[SCORED_BY_KEY]) if SCORED_BY_KEY in metadata else None


def _json_safe(value: Any) -> Any:
    """`value` with every non-finite float as its name ("NaN", "Infinity", "-Infinity"): strict JSON has none, and
    the rejects file stays readable by any JSON reader."""
    if isinstance(value, float) and not math.isfinite(value):
        return json.dumps(value)
    if isinstance(value, dict):
        return {key: _json_safe(inner) for key, inner in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(inner) for inner in value]
    return value


def decode_json_line(line: bytes) -> Any:
    """One JSONL line as JSON; a UTF-8 byte-order mark (which some editors write at a file's start) is dropped."""
    try:
        return json.loads(line.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise BadRow("invalid_json", f"the line is not UTF-8 text ({e}); expected one JSON object per line") from e
    except json.JSONDecodeError as e:
        raise BadRow(
            "invalid_json", f"the line is not valid JSON ({e.msg} at character {e.pos + 1}); expected one JSON object"
        ) from e


def _fit_length(row: Row, config: DataConfig, report: DataReport) -> Row | None:
    """Apply data.max_prompt_length / max_response_length (eos included): drop (filter) or cut (truncate) the row,
    or raise a `DataError` naming it (error).

    Truncation keeps the prompt tokens `data.prompt_truncation` names (as verl's `data.truncation` does) and the
    first response tokens, cutting the per-token lists alike."""
    max_prompt, max_response = config.max_prompt_length, config.max_response_length
    long_prompt, long_response = len(row.prompt_ids) > max_prompt, len(row.response_ids) > max_response
    if not (long_prompt or long_response):
        return row
    if config.overlong_policy == "error":
        parts = (("prompt", row.prompt_ids, max_prompt), ("response", row.response_ids, max_response))
        over = [f"{part} has {len(ids)} tokens > data.max_{part}_length={limit}" for part, ids, limit in parts
                if len(ids) > limit]  # fmt: skip
        raise DataError(
            f"{row.source}: {' and '.join(over)} (data.overlong_policy=error; verl: data.truncation=error); raise the "
            "limit, or set data.overlong_policy=filter (drop such rows) or truncate"
        )
    if config.overlong_policy == "filter":
        report.filtered_overlong += 1
        return None
    if row.routed_experts is not None:
        raise DataError(
            f"{row.source}: the row is over-long and 'routed_experts' describe the whole sequence: cut, every later "
            "token would see another context than the one routed; set data.overlong_policy=filter (or raise the limits)"
        )
    report.truncated_prompt += long_prompt
    report.truncated_response += long_response
    return dataclasses.replace(
        row,
        prompt_ids=[
            i
            for kept in prompt_kept(len(row.prompt_ids), max_prompt, config.prompt_truncation)
            for i in row.prompt_ids[kept]
        ],
        response_ids=row.response_ids[:max_response],
        token_rewards=None if row.token_rewards is None else row.token_rewards[:max_response],
        behavior_log_probs=None if row.behavior_log_probs is None else row.behavior_log_probs[:max_response],
    )
