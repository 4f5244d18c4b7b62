"""Reading a W&B offline run back from its `run-<id>.wandb` file: W&B's LevelDB-style record log, each record one of
W&B's own protobuf `Record`s (`wandb.proto.wandb_internal_pb2`).

The log: a 7-byte file header (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a 7-byte
header (CRC-32 of the type byte and the data, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail
shorter than a header is zero padding. Each CRC is checked."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    """What an offline run recorded: its project and name, its config and each logged step's values."""

    project: str = ""
    name: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: dict[int, dict[str, float]] = field(default_factory=dict)  # step → {metric: value}, W&B's own "_" keys out


def read_wandb_run(path: Path) -> WandbRun:
    from wandb.proto import wandb_internal_pb2

    run = WandbRun()
    for payload in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.project, run.name = record.run.project, record.run.display_name
            run.config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "config":
            run.config |= {item.key: json.loads(item.value_json) for item in record.config.update}
        elif kind == "history":
            items = {"/".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            run.history[int(items.pop("_step"))] = {k: v for k, v in items.items() if not k.startswith("_")}
    run.config.pop("_wandb", None)
    return run


def _records(data: bytes) -> list[bytes]:
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), f"not a W&B run file: header {data[:HEADER]!r}"
    records, pending, position = [], b"", HEADER
    while position + HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < HEADER:
            position += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + HEADER])
        if kind == 0 and length == 0:  # the rest of the block is padding
            position += left
            continue
        chunk = data[position + HEADER : position + HEADER + length]
        assert checksum == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"bad CRC at byte {position}"
        position += HEADER + length
        pending += chunk
        if kind in (FULL, LAST):
            records.append(pending)
            pending = b""
    return records
