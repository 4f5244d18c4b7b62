"""The prepared dataset: the rows `read_rows` yields, written once into files that every rank opens in place.

A prepared directory holds
    tokens.bin/.idx              Megatron-Core `IndexedDataset`, int32: a row's prompt ids then its response ids
    token_rewards.bin/.idx       `IndexedDataset`, float32: one value per response id (empty where the row has none)
    behavior_log_probs.bin/.idx  likewise, the behaviour policy's log-probs
    routed_experts.bin/.idx      (R3 only) `IndexedDataset`, uint8 (int16 past 256 experts): [tokens × layers × k]
    rows.arrow                   an Arrow IPC file, one record a row: prompt_length, reward (null with token rewards),
                                 whether the per-token columns are given, uid, data_source, source ("path:line"),
                                 ground_truth and extra_info (JSON text, null when absent), routed_tokens
    report.json                  the `DataReport` of the preparation; rejects.jsonl beside it (skip mode)

The token-shaped columns are what Megatron-LM's own preprocessing writes (`IndexedDatasetBuilder`): a flat binary
of one dtype and an index of lengths and offsets; `IndexedDataset` reads the index, and a row is one `os.pread` from
the `.bin` held open (`_TokenFile`): not a mapping, which would count the page cache's folios around every drawn
row (2 MB each here) in each rank's resident memory, nor Megatron's file reader, which opens the file for every row
(a metadata round trip each on a parallel filesystem). The per-row fields are strings, JSON and nulls, which the
indexed format has no place for: Arrow's IPC file keeps them, memory-mapped (`pa.memory_map`: no copy), and a
batch's records are taken from it in one call (`Table.take`).

Per-token floats are stored as float32, the precision `collate` gives them (`torch.tensor` of Python floats): a row
read back differs from `read_rows`' only below float32, and its batch not at all. A `Row` is materialized only when
drawn (`rows_at`), so a rank's resident memory of the data is O(batch); the node's page cache holds one copy of the
files for all its ranks.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_ppo.data.parse import Row
from megatron_ppo.data.values import RoutingShape

TOKENS, TOKEN_REWARDS, BEHAVIOR = "tokens", "token_rewards", "behavior_log_probs"
ROUTED = "routed_experts"
ROWS_FILE = "rows.arrow"
ROWS_SCHEMA = pa.schema([
    ("prompt_length", pa.int32()),
    ("reward", pa.float64()),
    ("has_token_rewards", pa.bool_()),
    ("has_behavior_log_probs", pa.bool_()),
    ("uid", pa.string()),
    ("data_source", pa.string()),
    ("source", pa.string()),
    ("ground_truth", pa.string()),
    ("extra_info", pa.string()),
    ("routed_tokens", pa.int32()),
])  # fmt: skip
ROWS_PER_WRITE = 4096  # rows buffered before their columns are written


def routed_dtype(routing: RoutingShape) -> type[np.integer]:
    """The narrowest type holding every expert index of the model."""
    return np.uint8 if routing.num_experts <= 256 else np.int16


class PreparedWriter:
    """Rows appended in order to a new prepared directory, a buffer of `ROWS_PER_WRITE` at a time."""

    def __init__(self, directory: Path, routing: RoutingShape | None = None) -> None:
        self.directory, self.routing = directory, routing
        directory.mkdir(parents=True, exist_ok=True)
        self.columns = {TOKENS: np.int32, TOKEN_REWARDS: np.float32, BEHAVIOR: np.float32}
        if routing is not None:
            self.columns[ROUTED] = routed_dtype(routing)
        self.builders = {name: IndexedDatasetBuilder(str(directory / f"{name}.bin"), dtype=dtype)
                         for name, dtype in self.columns.items()}  # fmt: skip
        self.table = pa.ipc.new_file(str(directory / ROWS_FILE), ROWS_SCHEMA)
        self.pending: list[Row] = []
        self.rows = 0

    def add(self, row: Row) -> None:
        self.pending.append(row)
        if len(self.pending) == ROWS_PER_WRITE:
            self._write()

    def add_columns(self, records: dict[str, list[Any]], arrays: dict[str, tuple[np.ndarray, list[int]]]) -> None:
        """Rows given column-wise (a fast reader's): `records` the `ROWS_SCHEMA` fields as lists, `arrays` each
        token column as (flat values, one length per row)."""
        self._write()
        for name, builder in self.builders.items():
            values, lengths = arrays[name]
            builder.add_document(values, lengths)
        self.table.write_batch(pa.record_batch(records, schema=ROWS_SCHEMA))
        self.rows += len(records["source"])

    def _write(self) -> None:
        rows, self.pending = self.pending, []
        if not rows:
            return
        tokens = [np.asarray(ids, dtype=np.int32) for row in rows for ids in (row.prompt_ids, row.response_ids)]
        arrays = {
            TOKENS: (_concatenated(tokens, np.int32), [len(r.prompt_ids) + len(r.response_ids) for r in rows]),
            TOKEN_REWARDS: _per_token(rows, "token_rewards"),
            BEHAVIOR: _per_token(rows, "behavior_log_probs"),
        }
        if self.routing is not None:
            routes = [np.asarray(r.routed_experts).reshape(-1) if r.routed_experts is not None else np.zeros(0)
                      for r in rows]  # fmt: skip
            arrays[ROUTED] = (_concatenated(routes, self.columns[ROUTED]), [len(r) for r in routes])
        records = {
            "prompt_length": [len(r.prompt_ids) for r in rows],
            "reward": [r.reward for r in rows],
            "has_token_rewards": [r.token_rewards is not None for r in rows],
            "has_behavior_log_probs": [r.behavior_log_probs is not None for r in rows],
            "uid": [r.uid for r in rows],
            "data_source": [r.data_source for r in rows],
            "source": [r.source for r in rows],
            "ground_truth": [None if r.ground_truth is None else json.dumps(r.ground_truth) for r in rows],
            "extra_info": [None if r.extra_info is None else json.dumps(r.extra_info) for r in rows],
            "routed_tokens": [None if r.routed_experts is None else len(r.routed_experts) for r in rows],
        }
        self.add_columns(records, arrays)

    def finish(self) -> int:
        """Write what is buffered and the indexes; returns the number of rows."""
        self._write()
        self.table.close()
        for name, builder in self.builders.items():
            builder.finalize(str(self.directory / f"{name}.idx"))
        return self.rows


def _concatenated(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _per_token(rows: list[Row], name: str) -> tuple[np.ndarray, list[int]]:
    values = [getattr(r, name) or [] for r in rows]
    return np.asarray([v for row in values for v in row], dtype=np.float32), [len(v) for v in values]


class PreparedRows(Sequence[Row]):
    """A prepared directory mapped: `len`, and the `Row` at an index materialized when asked (`rows_at` for many
    at once); `column` reads one field of every row without materializing any."""

    def __init__(self, directory: str | Path, routing: RoutingShape | None = None) -> None:
        self.directory, self.routing = Path(directory), routing
        self.table = pa.ipc.open_file(pa.memory_map(str(self.directory / ROWS_FILE))).read_all()
        names = [TOKENS, TOKEN_REWARDS, BEHAVIOR] + ([ROUTED] if routing is not None else [])
        # a column no row has is an empty .bin: its rows read as empty
        self.arrays = {name: _TokenFile(self.directory / name) for name in names
                       if os.path.getsize(self.directory / f"{name}.bin")}  # fmt: skip
        if len(self.arrays[TOKENS]) != self.table.num_rows:
            raise ValueError(f"{self.directory}: {len(self.arrays[TOKENS])} token rows but {self.table.num_rows} "
                             "rows in rows.arrow: the prepared dataset is incomplete")  # fmt: skip

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> Row:  # type: ignore[override]
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        return self.rows_at([index % len(self)])[0]

    def rows_at(self, indices: Iterable[int]) -> list[Row]:
        """The rows at `indices`, in that order."""
        indices = [int(i) for i in indices]
        records = self.table.take(pa.array(indices, type=pa.int64())).to_pylist()
        return [self._row(i, record) for i, record in zip(indices, records, strict=True)]

    def column(self, name: str) -> list[Any]:
        """Field `name` of every row: a `ROWS_SCHEMA` column."""
        return self.table.column(name).to_pylist()

    def _row(self, index: int, record: dict[str, Any]) -> Row:
        tokens = self.arrays[TOKENS][index].tolist()
        prompt = record["prompt_length"]
        routes = None
        if record["routed_tokens"] is not None:
            assert self.routing is not None
            flat = self.arrays[ROUTED][index].astype(np.int32)
            routes = torch.from_numpy(flat.reshape(record["routed_tokens"], self.routing.num_layers, self.routing.topk))
        return Row(
            prompt_ids=tokens[:prompt],
            response_ids=tokens[prompt:],
            reward=record["reward"],
            token_rewards=self._values(TOKEN_REWARDS, index) if record["has_token_rewards"] else None,
            behavior_log_probs=self._values(BEHAVIOR, index) if record["has_behavior_log_probs"] else None,
            uid=record["uid"],
            data_source=record["data_source"],
            source=record["source"],
            routed_experts=routes,
            ground_truth=None if record["ground_truth"] is None else json.loads(record["ground_truth"]),
            extra_info=None if record["extra_info"] is None else json.loads(record["extra_info"]),
        )

    def _values(self, name: str, index: int) -> list[float]:
        return self.arrays[name][index].tolist() if name in self.arrays else []


class _TokenFile:
    """One token column: its index read by `IndexedDataset` (lengths and byte offsets), its `.bin` held open, and
    row `i` read with one `os.pread` (module docstring)."""

    def __init__(self, prefix: Path) -> None:
        with warnings.catch_warnings():  # Megatron's reader asks for a rank where no process group exists yet
            warnings.filterwarnings("ignore", "Could not determine rank", UserWarning)
            self.index = IndexedDataset(str(prefix), mmap=False).index
        self.dtype = np.dtype(self.index.dtype)
        self.file = open(f"{prefix}.bin", "rb", buffering=0)  # noqa: SIM115 — closed with this object

    def __len__(self) -> int:
        return len(self.index.sequence_lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        count, offset = int(self.index.sequence_lengths[i]), int(self.index.sequence_pointers[i])
        return np.frombuffer(os.pread(self.file.fileno(), count * self.dtype.itemsize, offset), self.dtype)


def column(rows: Sequence[Row], name: str) -> list[Any]:
    """Field `name` of every row (`uid`, `source`, `data_source`, or `has_behavior_log_probs`): from a prepared
    dataset's table without materializing a row, else from the rows."""
    if isinstance(rows, PreparedRows):
        return rows.column(name)
    if name == "has_behavior_log_probs":
        return [row.behavior_log_probs is not None for row in rows]
    return [getattr(row, name) for row in rows]


def rows_at(rows: Sequence[Row], indices: Iterable[int]) -> list[Row]:
    """`[rows[i] for i in indices]`, in one read where `rows` is a prepared dataset."""
    if isinstance(rows, PreparedRows):
        return rows.rows_at(indices)
    return [rows[int(i)] for i in indices]
