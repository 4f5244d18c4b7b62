"""The drill's verdict, read back from the run's TensorBoard files with TensorBoard's own reader: where each guard
fired, what it did, and the first clean iteration after it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from megatron_ppo.report import find_runs
from tests.drill.faults import Fault

# Events that report rather than correct: they do not make an iteration unclean.
NOT_CORRECTIONS = ("guard/watch", "guard/lr_floor", "guard/rollback")


@dataclass(frozen=True)
class DrillRow:
    fault: str
    injected: int
    guard: str
    fired_at: list[int]
    action: str
    recovered_by: int | None


def _accumulator(log_dir: str | Path) -> EventAccumulator:
    accumulator = EventAccumulator(str(find_runs(log_dir)[-1]), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def check(log_dir: str | Path, faults: list[Fault]) -> tuple[list[DrillRow], list[str]]:
    """One row per fault, and what went wrong: a guard that did not fire at its fault's step, or fired elsewhere."""
    accumulator = _accumulator(log_dir)
    tags = accumulator.Tags()
    guard_events = {tag: accumulator.Scalars(tag) for tag in tags["scalars"] if tag.startswith("guard/")}
    messages = {
        (tag.removesuffix("/text_summary"), event.step): tensor_util.make_ndarray(event.tensor_proto).reshape(-1)[0]
        for tag in tags["tensors"] if tag.startswith("guard/") for event in accumulator.Tensors(tag)
    }  # fmt: skip
    iterations = sorted((e.wall_time, e.step) for e in accumulator.Scalars("reward/mean"))
    corrections = sorted(e.wall_time for tag, events in guard_events.items() if tag not in NOT_CORRECTIONS
                         for e in events)  # fmt: skip
    expected: dict[str, list[int]] = {}
    for fault in faults:
        for guard in fault.guards:
            expected.setdefault(guard, []).append(fault.fires_at)
    fired = {guard: sorted({e.step for e in guard_events.get(f"guard/{guard}", [])}) for guard in expected}
    problems = [f"guard/{guard} fired at steps {fired[guard]}, expected exactly {sorted(steps)}"
                for guard, steps in expected.items() if fired[guard] != sorted(steps)]  # fmt: skip
    rows = []
    for fault in faults:
        tag = f"guard/{fault.guards[0]}"
        at = next((e for e in guard_events.get(tag, []) if e.step == fault.fires_at), None)
        recovered = None if at is None else _first_clean_iteration(at.wall_time, iterations, corrections)
        if at is not None and recovered is None:
            problems.append(f"{fault.name}: no clean iteration after {tag} fired")
        message = messages.get((tag, fault.fires_at), b"").decode()
        rows.append(DrillRow(fault.name, fault.step, " + ".join(fault.guards), fired[fault.guards[0]], message,
                             recovered))  # fmt: skip
    return rows, problems


def _first_clean_iteration(after: float, iterations: list[tuple[float, int]], corrections: list[float]) -> int | None:
    """The step of the first iteration with no corrective guard event between the iteration logged before it and its
    own metrics, among those logged after `after` (an iteration's guards act before its metrics are logged, so the
    iteration that fired is not clean). After a rollback, step numbers restart at the checkpoint's."""
    previous = max((t for t, _ in iterations if t <= after), default=-1.0)
    for wall_time, step in iterations:
        if wall_time <= after:
            continue
        if not any(previous < t <= wall_time for t in corrections):
            return step
        previous = wall_time
    return None


def drill_table(rows: list[DrillRow], summary: dict[str, float]) -> None:
    table = Table(title="fault drill: the tiny recipe with injected faults")
    for column in ("fault", "injected at step", "guard", "fired at step", "action", "recovered by step"):
        table.add_column(column, justify="left" if column in ("fault", "guard", "action") else "right")
    for row in rows:
        table.add_row(row.fault, str(row.injected), row.guard, ", ".join(map(str, row.fired_at)) or "—",
                      row.action, "—" if row.recovered_by is None else str(row.recovered_by))  # fmt: skip
    table.caption = (f"held-out accuracy: SFT start {summary['accuracy_before']:.3f} → after PPO "
                     f"{summary['accuracy_after']:.3f}. Recovered by: the first later iteration no guard corrected "
                     "(after a rollback, step numbers restart at the checkpoint's).")  # fmt: skip
    Console(width=200).print(table)
