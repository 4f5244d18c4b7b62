"""Preparing the dataset once: keyed by what makes its rows, written by one process of a job, read by every rank.

The key (`dataset_key`) is everything a kept row depends on: each file as named (its rows' sources say the name)
with its size and a hash of its content (not its modification time: a copy is the same data, an overwrite in place
is not), the tokenizer's files' hash, the `data` keys that change a token or a row (all of them but those in
`NOT_IN_KEY`: a key added later is in the key until said otherwise), the scorer (and its file's hash), the routing
shape (R3) and the format's version. The prepared directory is `<root>/<digest of the key>`; `key.json` in it says
what the key was made of.

Who prepares: the first process to take an advisory lock on `<root>/<digest>.lock` (`fcntl.flock`, dropped by the
kernel however its holder dies). It writes into `<digest>.partial-<host>-<pid>` and renames that to `<digest>` when
every file is written (`report.json` last), so a prepared directory is whole or absent: a preparer killed midway
leaves a partial directory that no one reads, and the next preparer removes it. The others wait on the lock, saying
so, then open what it wrote. flock is exclusive across nodes on local disks, NFSv4 and Lustre mounted with `-o flock`
(as the run directory's lock, `checkpoint/lock.py`).
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from megatron_ppo.config.schema import DataConfig, PPOConfig
from megatron_ppo.data.columnar import RowColumns
from megatron_ppo.data.parse import Tokenizer
from megatron_ppo.data.prepared import PreparedRows, PreparedWriter
from megatron_ppo.data.rows import DataError, DataReport, format_of, stream_rows
from megatron_ppo.data.scoring import Scorer
from megatron_ppo.data.values import RoutingShape

FORMAT_VERSION = 1
# the data keys that change no token and no row: which files (in the key by themselves), how rows are drawn, where
# the prepared data lives, and the tiny task's own settings (its files are the data)
NOT_IN_KEY = ("train_files", "val_files", "train_batch_size", "shuffle", "seed", "task", "addition", "prepared_dir")
HASH_BLOCK = 64 << 20  # bytes a thread hashes at a time
REPORT_FILE, KEY_FILE, REJECTS_FILE = "report.json", "key.json", "rejects.jsonl"
FAILED_SUFFIX = ".failed"  # beside a prepared directory: why the last preparation stopped
PROGRESS_EVERY_S = 10.0


def prepared_root(config: PPOConfig) -> Path:
    """Where a run's data is prepared: `data.prepared_dir`, else `<trainer.default_local_dir>/prepared` (writable
    by the run, checked at its start, and kept across its resumes and requeues)."""
    return Path(config.data.prepared_dir or os.path.join(config.trainer.default_local_dir, "prepared"))


def content_hash(path: str | Path) -> str:
    """SHA-256 over the SHA-256 of each `HASH_BLOCK` of the file, the blocks hashed on every core (hashlib releases
    the GIL): ~1 GB/s a core."""

    def block(offset: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return hashlib.sha256(f.read(HASH_BLOCK)).digest()

    size = os.path.getsize(path)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        digests = list(pool.map(block, range(0, size, HASH_BLOCK)))
    return hashlib.sha256(b"".join(digests)).hexdigest()


def tokenizer_files(tokenizer: Tokenizer) -> list[Path]:
    """The files a tokenizer is made of: its own (`path`) and the configuration beside it that names its special
    tokens and chat template."""
    path = getattr(tokenizer, "path", None)
    if path is None:
        return []
    siblings = ("tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")
    return [Path(path), *(p for name in siblings if (p := Path(path).parent / name).is_file())]


def dataset_key(
    paths: Sequence[str | Path], tokenizer: Tokenizer, config: DataConfig, scorer: Scorer | None,
    routing: RoutingShape | None,
) -> dict[str, Any]:  # fmt: skip
    """Everything the prepared rows depend on (module docstring), as JSON-able values."""
    data = {k: v for k, v in dataclasses.asdict(config).items() if k not in NOT_IN_KEY}
    return {
        "format": FORMAT_VERSION,
        "files": [{"path": str(p), "bytes": os.path.getsize(p), "sha256": content_hash(p)} for p in paths],
        "tokenizer": {str(p): content_hash(p) for p in tokenizer_files(tokenizer)} or type(tokenizer).__qualname__,
        "data": data,
        "scorer": None if scorer is None else {"name": scorer.name, "file": _file_hash(scorer.source)},
        "routing": None if routing is None else list(routing),
    }


def _file_hash(path: str | None) -> str | None:
    return content_hash(path) if path and os.path.isfile(path) else None


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class PreparedData:
    """A mapped prepared dataset, the report of its preparation, and how this process came to it."""

    rows: PreparedRows
    report: DataReport
    directory: Path
    how: str  # "prepared here in N s", "prepared by <who> (waited N s)" or "prepared earlier"

    def line(self) -> str:
        return f"data: {len(self.rows)} rows {self.how} in {self.directory}"


def prepared_rows(
    paths: Sequence[str | Path],
    tokenizer: Tokenizer,
    config: DataConfig,
    root: str | Path,
    scorer: Scorer | None = None,
    routing: RoutingShape | None = None,
    say: Callable[[str], None] = print,
) -> PreparedData:
    """The rows `read_rows(paths, ...)` gives, prepared under `root` (module docstring) and mapped. `say` gets the
    lines a user sees: waiting for another process, progress while preparing. Raises `read_rows`' `DataError`s."""
    for p in paths:
        format_of(Path(p), config.format)  # a missing file or an unknown format is named before any hashing
    key = dataset_key(paths, tokenizer, config, scorer, routing)
    directory = Path(root) / key_digest(key)
    started = time.perf_counter()
    who = _prepare_once(directory, lambda into: _prepare(into, key, paths, tokenizer, config, scorer, routing, say),
                        say)  # fmt: skip
    report = DataReport(**json.loads((directory / REPORT_FILE).read_text()))
    seconds = f"{time.perf_counter() - started:.1f} s"
    how = {None: "prepared earlier", "": f"prepared here in {seconds}"}.get(
        who, f"prepared by {who} (waited {seconds})"
    )
    return PreparedData(PreparedRows(directory, routing), report, directory, how)


def _prepare_once(directory: Path, prepare: Callable[[Path], None], say: Callable[[str], None]) -> str | None:
    """`prepare(into)` run by one process, `into` then renamed to `directory`. Returns "" when this process
    prepared, the preparer it waited for, or None when the directory was there already. A preparer stopped by its
    data (a `DataError`: a bad row in error mode, no row left) leaves the message in `<key>.failed`, and the
    processes that waited for it raise the same error instead of reading the data again; a later start (which did
    not wait) prepares anew: the data or the scorer's world may have changed."""
    if (directory / REPORT_FILE).is_file():
        return None
    failed = directory.with_name(directory.name + FAILED_SUFFIX)
    me = f"{socket.gethostname()} pid {os.getpid()}"
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        lock_file = open(directory.with_name(directory.name + ".lock"), "a+")  # noqa: SIM115 — closed below
    except OSError as error:
        raise DataError(
            f"data.prepared_dir={str(directory.parent)!r} cannot be written ({error.strerror}) and the data is not "
            "prepared there yet: point data.prepared_dir at a writable folder, or prepare it where it can be written "
            "(megatron-ppo prepare RECIPE data.prepared_dir=...)"
        ) from error
    with lock_file as lock:
        holder, waited_from = None, time.time()
        try:
            _lock(lock, blocking=False)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "another process"
            say(f"data: waiting for {holder} to prepare {directory}")
            _lock(lock, blocking=True)
            lock.seek(0)
            holder = lock.read().strip() or holder  # named by now, if it had not yet written its name
        try:
            if (directory / REPORT_FILE).is_file():
                return holder
            if holder is not None and failed.is_file() and failed.stat().st_mtime >= waited_from - 1:
                raise DataError(failed.read_text())
            failed.unlink(missing_ok=True)
            lock.truncate(0)
            lock.write(me)
            lock.flush()
            for partial in directory.parent.glob(directory.name + ".partial-*"):  # left by a preparer that died
                shutil.rmtree(partial, ignore_errors=True)
            into = directory.with_name(f"{directory.name}.partial-{socket.gethostname()}-{os.getpid()}")
            try:
                prepare(into)
                os.rename(into, directory)
            except DataError as error:
                shutil.rmtree(into, ignore_errors=True)
                _write_durably(failed, str(error))
                raise
            except BaseException:
                shutil.rmtree(into, ignore_errors=True)
                raise
            return ""
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _lock(lock: IO[str], blocking: bool) -> None:
    """flock the file; a filesystem without locks is the user's to change, said in one line."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        raise
    except OSError as error:
        raise DataError(
            f"{lock.name}: the filesystem of data.prepared_dir refuses file locks ({error.strerror}), which keep two "
            "processes from preparing the same data at once; set data.prepared_dir to a local disk, NFSv4 or Lustre "
            "mounted with -o flock"
        ) from error


def _prepare(
    into: Path, key: dict[str, Any], paths: Sequence[str | Path], tokenizer: Tokenizer, config: DataConfig,
    scorer: Scorer | None, routing: RoutingShape | None, say: Callable[[str], None],
) -> None:  # fmt: skip
    """Every kept row written into `into`, then the report and the key."""
    final = into.with_name(into.name.split(".partial-")[0])
    say(f"data: preparing {len(paths)} file(s) into {final} (once: later runs, resumes and requeues open it)")
    writer = PreparedWriter(into, routing)
    report = DataReport(scorer=None if scorer is None else scorer.name)
    progress = _Progress(say, report)
    for rows in stream_rows(paths, tokenizer, config, report, into / REJECTS_FILE, scorer, routing, columnar=True):
        if isinstance(rows, RowColumns):
            writer.add_columns(rows.records, rows.arrays)
            progress.tokens_done(rows.tokens)
        else:
            writer.add(rows)
            progress.tokens_done(len(rows.prompt_ids) + len(rows.response_ids))
    writer.finish()
    if report.rejects_path is not None:
        report.rejects_path = str(final / REJECTS_FILE)
    (into / KEY_FILE).write_text(json.dumps(key, indent=1, sort_keys=True))
    _write_durably(into / REPORT_FILE, json.dumps(dataclasses.asdict(report), indent=1))
    progress.done()


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


class _Progress:
    """A line every `PROGRESS_EVERY_S` while preparing: rows read and kept, tokens, tokens/s."""

    def __init__(self, say: Callable[[str], None], report: DataReport) -> None:
        self.say, self.report = say, report
        self.started = self.last = time.perf_counter()
        self.tokens = 0

    def tokens_done(self, tokens: int) -> None:
        self.tokens += tokens
        if (now := time.perf_counter()) - self.last >= PROGRESS_EVERY_S:
            self.last = now
            self.say(
                f"data: prepared {self.report.rows_kept} rows of {self.report.rows_read} read, "
                f"{self.tokens / 1e6:.1f}M tokens, {self.tokens / (now - self.started) / 1e6:.2f}M tokens/s"
            )

    def done(self) -> None:
        elapsed = time.perf_counter() - self.started
        self.say(f"data: prepared {self.report.rows_kept} rows ({self.tokens / 1e6:.1f}M tokens) in {elapsed:.1f} s, "
                 f"{self.tokens / max(elapsed, 1e-9) / 1e6:.2f}M tokens/s")  # fmt: skip
