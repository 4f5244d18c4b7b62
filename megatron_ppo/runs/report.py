"""`report`: what a run left in TensorBoard — each scalar's first, last, min and max with their steps; the guard
events grouped by kind (how often, at which steps, the last message); the evaluation history; then every guard,
checkpoint, preemption and job event in step order; and the profiler's traces and memory snapshots in the run's
folder (`profiling.*`). Read with TensorBoard's own reader, so it
works on a run still in progress, on a finished one, or on one copied off the cluster.

    python -m megatron_ppo report outputs/tiny/tensorboard     (or the recipe: its trainer.log_dir)
    python -m megatron_ppo report outputs/tiny/tensorboard/20261201-004445-3fa9c1

Each run writes into its own folder `<trainer.log_dir>/<run id>/`. Given `trainer.log_dir`, the report reads the run
written most recently and names it and the others; given a run's folder, it reads that run. `report ... --plot`
draws runs instead (`figure.py`), from what `load_run` reads here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from megatron_ppo.config.errors import UserError
from megatron_ppo.train.profiling import TRACES

LOG_WIDTH = 240  # columns of a table printed into a file or pipe


def table_console() -> Console:
    """Standard output for a table: at a terminal its width; into a file or pipe (a Slurm log, `make ... > log`)
    `LOG_WIDTH` columns unless `COLUMNS` says otherwise, where rich would take 80 and wrap a table of many columns
    into cells a few characters wide."""
    console = Console()
    if console.is_terminal or "COLUMNS" in os.environ:
        return console
    return Console(width=LOG_WIDTH)


@dataclass(frozen=True)
class ScalarSummary:
    tag: str
    steps: int
    first: tuple[int, float]
    last: tuple[int, float]
    low: tuple[int, float]
    high: tuple[int, float]


@dataclass(frozen=True)
class Event:
    step: int
    tag: str
    message: str
    wall_time: float


@dataclass(frozen=True)
class RunLog:
    """What one run wrote to TensorBoard, read back whole: every scalar write in write order (a step written again,
    as after a rollback or a resume, appears twice) and the text events in step, then write order."""

    folder: Path
    writes: dict[str, list[tuple[float, int, float]]]  # tag → [(wall time, step, value)], in write order
    events: list[Event]

    def scalars(self, tag: str) -> dict[int, float]:
        """step → value of `tag`, ascending steps, the last value written for a step winning; {} if never written."""
        return dict(sorted({step: value for _, step, value in self.writes.get(tag, [])}.items()))

    def superseded(self, tag: str) -> list[tuple[int, float]]:
        """(step, value) of each write of `tag` that a later write of the same step replaced: what an iteration
        abandoned by a rollback logged before the run went back and ran that step again."""
        writes = self.writes.get(tag, [])
        last = {step: index for index, (_, step, _) in enumerate(writes)}
        return [(step, value) for index, (_, step, value) in enumerate(writes) if last[step] != index]


class RunNotFound(UserError, FileNotFoundError):
    """No TensorBoard run where one was named, or event files with nothing readable in them."""


def _event_files(folder: Path) -> list[Path]:
    return [path for path in folder.glob("events.out.tfevents.*") if path.is_file()]


def find_runs(log_dir: str | Path) -> list[Path]:
    """The run folders `log_dir` stands for, the one written most recently last: `log_dir` itself when it holds
    event files (a run's own folder), else its subfolders that do."""
    log_dir = Path(log_dir)
    if not log_dir.is_dir():
        raise RunNotFound(f"no TensorBoard directory at {log_dir} (has the run started? see trainer.log_dir)")
    if _event_files(log_dir):
        return [log_dir]
    runs = [folder for folder in log_dir.iterdir() if folder.is_dir() and _event_files(folder)]
    if not runs:
        raise RunNotFound(f"no TensorBoard run in {log_dir} (neither event files nor run folders holding them; has "
                          "the run started? see trainer.log_dir)")  # fmt: skip
    return sorted(runs, key=lambda folder: max(path.stat().st_mtime for path in _event_files(folder)))


def load_run(log_dir: str | Path) -> RunLog:
    """The newest run of `find_runs(log_dir)`, read with TensorBoard's own reader (nothing sampled away)."""
    folder = find_runs(log_dir)[-1]
    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    writes = {tag: [(e.wall_time, e.step, e.value) for e in accumulator.Scalars(tag)] for tag in tags["scalars"]}
    events = [
        Event(event.step, tag.removesuffix("/text_summary"),
              tensor_util.make_ndarray(event.tensor_proto).reshape(-1)[0].decode(), event.wall_time)
        for tag in tags["tensors"] for event in accumulator.Tensors(tag)
    ]  # fmt: skip
    if not writes and not events:  # TensorBoard's reader skips what it cannot parse: say so rather than show nothing
        names = ", ".join(path.name for path in _event_files(folder))
        raise RunNotFound(f"{folder}'s event files ({names}) hold no TensorBoard records: they are damaged or not "
                          "TensorBoard event files; give a run's folder as its trainer wrote it")  # fmt: skip
    return RunLog(folder, writes, sorted(events, key=lambda e: (e.step, e.wall_time)))


def summarise(log: RunLog) -> list[ScalarSummary]:
    """Per-tag scalar summaries, by tag (the last value written for a step wins)."""
    summaries = []
    for tag in sorted(log.writes):
        by_step = list(log.scalars(tag).items())
        summaries.append(ScalarSummary(tag, len(by_step), by_step[0], by_step[-1],
                                       min(by_step, key=lambda s: s[1]), max(by_step, key=lambda s: s[1])))  # fmt: skip
    return summaries


def read_run(log_dir: str | Path) -> tuple[list[ScalarSummary], list[Event]]:
    """The scalar summaries and the text events of one run: the newest of `find_runs(log_dir)`."""
    log = load_run(log_dir)
    return summarise(log), log.events


def evaluation_history(log: RunLog) -> dict[int, dict[str, float]]:
    """step → {eval metric: value} for every `eval/*` scalar of the run (the last value written for a step wins)."""
    history: dict[int, dict[str, float]] = {}
    for tag in log.writes:
        if tag.startswith("eval/"):
            for step, value in log.scalars(tag).items():
                history.setdefault(step, {})[tag.removeprefix("eval/")] = value
    return dict(sorted(history.items()))


def profile_files(run: Path) -> list[tuple[Path, str]]:
    """The traces and memory snapshots `profiling.*` left in a run's folder, each with what it is and opens in."""
    folder = run / TRACES
    found = []
    for path in sorted(folder.iterdir()) if folder.is_dir() else []:
        if path.name.endswith(".pt.trace.json"):
            found.append((path, "torch profiler trace (ui.perfetto.dev, chrome://tracing)"))
        elif path.suffix == ".pickle":
            found.append((path, "CUDA memory snapshot (pytorch.org/memory_viz)"))
    return found


def print_report(log_dir: str | Path, console: Console | None = None) -> None:
    *others, run = find_runs(log_dir)
    log = load_run(run)
    summaries, events = summarise(log), log.events
    console = console or table_console()
    table = Table(title=f"run {run.name} ({run})")
    for column in ("metric", "steps", "first", "last", "min (step)", "max (step)"):
        table.add_column(column, justify="left" if column == "metric" else "right", no_wrap=column == "metric")
    for s in summaries:
        table.add_row(s.tag, str(s.steps), f"{s.first[1]:.4g}", f"{s.last[1]:.4g} @{s.last[0]}",
                      f"{s.low[1]:.4g} ({s.low[0]})", f"{s.high[1]:.4g} ({s.high[0]})")  # fmt: skip
    console.print(table)
    guards: dict[str, list[Event]] = {}
    for event in events:
        if event.tag.startswith("guard/"):
            guards.setdefault(event.tag.removeprefix("guard/"), []).append(event)
    if guards:
        by_kind = Table(title="guard events by kind")
        for column in ("guard", "times", "steps", "last message"):
            by_kind.add_column(column, justify="right" if column == "times" else "left")
        for kind, fired in sorted(guards.items()):
            by_kind.add_row(kind, str(len(fired)), ", ".join(str(e.step) for e in fired), fired[-1].message)
        console.print(by_kind)
    evaluations = evaluation_history(log)
    if evaluations:
        history = Table(title="evaluations")
        names = sorted({name for values in evaluations.values() for name in values})
        for column in ("step", *names):
            history.add_column(column, justify="right")
        for step, values in sorted(evaluations.items()):
            history.add_row(str(step), *(f"{values[n]:.4g}" if n in values else "" for n in names))
        console.print(history)
    if events:
        log = Table(title="events")
        for column in ("step", "event", "message"):
            log.add_column(column, justify="right" if column == "step" else "left")
        for event in events:
            log.add_row(str(event.step), event.tag, event.message)
        console.print(log)
    profiles = profile_files(run)
    if profiles:
        files = Table(title=f"profiles ({run / TRACES})")
        for column in ("file", "what", "MiB"):
            files.add_column(column, justify="right" if column == "MiB" else "left")
        for path, what in profiles:
            files.add_row(path.name, what, f"{path.stat().st_size / 2**20:.2f}")
        console.print(files)
    if others:
        console.print(f"{len(others)} other run(s) in {log_dir}: {', '.join(o.name for o in others)}; report one "
                      f"with `python -m megatron_ppo report {Path(log_dir) / '<run>'}`")  # fmt: skip
