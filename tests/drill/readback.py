"""The drill's verdict, read back from the run's TensorBoard files with TensorBoard's own reader: where each guard
fired, what it did, which checkpoint its rollback loaded, the first clean iteration after it and the KL there."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.runs.report import find_runs
from megatron_ppo.train.guards import GUARD_STOP_EXIT, UPDATE_KL, GuardStopped
from tests.drill.faults import BEST_EVAL, Fault

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
    loaded: str = ""  # the checkpoint its rollback loaded (a stop: the one it left)
    kl_after: float | None = None  # the update's KL in the recovering iteration


def _accumulator(log_dir: str | Path) -> EventAccumulator:
    # every event, also those of steps a rollback repeated (TensorBoard would purge them by default)
    accumulator = EventAccumulator(
        str(find_runs(log_dir)[-1]), size_guidance={"scalars": 0, "tensors": 0}, purge_orphaned_data=False
    )
    accumulator.Reload()
    return accumulator


def check(log_dir: str | Path, faults: list[Fault], kl_threshold: float) -> tuple[list[DrillRow], list[str]]:
    """One row per fault, and what went wrong: a guard that did not fire at its fault's step, or fired elsewhere; a
    rollback that loaded another checkpoint than the fault's `loads` (`BEST_EVAL`: the step of the best evaluation
    the run held when the guard fired, `_best_evaluation`); a KL fault whose recovering iteration's KL is not back
    under `kl_threshold`."""
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
    kls = accumulator.Scalars(UPDATE_KL)
    rows = []
    for fault in faults:
        tag = f"guard/{fault.guards[0]}"
        at = next((e for e in guard_events.get(tag, []) if e.step == fault.fires_at), None)
        recovered = None if at is None else _first_clean_iteration(at.wall_time, iterations, corrections)
        if at is not None and recovered is None:
            problems.append(f"{fault.name}: no clean iteration after {tag} fired")
        message = messages.get((tag, fault.fires_at), b"").decode()
        rollback = messages.get(("guard/rollback", fault.fires_at), b"").decode()
        loaded = _loaded(rollback) or ""
        loads = fault.loads
        if loads == BEST_EVAL:
            loads = None if at is None else _best_evaluation(accumulator, at.wall_time)
        if fault.loads is not None and (loads is None or loaded != f"step_{loads}"):
            problems.append(f"{fault.name}: its rollback loaded {loaded or 'nothing'}, expected step_{loads}")
        kl_after = None
        if at is not None and recovered is not None:
            kl_after = next((e.value for e in kls if e.wall_time > at.wall_time and e.step == recovered), None)
        if fault.name.startswith("kl_") and not (kl_after is not None and kl_after <= kl_threshold):
            problems.append(f"{fault.name}: {UPDATE_KL} after recovery is {kl_after}, not ≤ {kl_threshold}")
        rows.append(DrillRow(fault.name, fault.step, " + ".join(fault.guards), fired[fault.guards[0]], message,
                             recovered, loaded, kl_after))  # fmt: skip
    return rows, problems


def check_stop(stopped: GuardStopped | None, config: PPOConfig, step: int) -> tuple[DrillRow, list[str]]:
    """The guard-stop run: stopped by `guard/nonfinite` at `step` with `GUARD_STOP_EXIT`, one message naming the guard,
    its value and threshold and the good checkpoint left (step − 2: the save at step − 1 is the one `step` judged),
    which `latest` names."""
    left = f"step_{step - 2}"
    message = "" if stopped is None else str(stopped)
    problems = [] if stopped is not None else ["the guard-stop run was not stopped by a guard"]
    if stopped is not None and stopped.exit_status != GUARD_STOP_EXIT:
        problems.append(f"the guard stop exits {stopped.exit_status}, not {GUARD_STOP_EXIT}")
    for part in ("guard/nonfinite", "guards.max_consecutive_skips=0", left):
        if part not in message:
            problems.append(f"the stop message does not name {part!r}: {message!r}")
    latest = Path(config.trainer.default_local_dir) / "latest"
    named = latest.read_text().strip() if latest.is_file() else None
    if named != left:
        problems.append(f"after the stop `latest` names {named}, not the good checkpoint {left}")
    fired = sorted({e.step for e in _accumulator(config.trainer.log_dir).Scalars("guard/nonfinite")})
    if fired != [step]:
        problems.append(f"guard/nonfinite fired at steps {fired} of the stop run, expected exactly [{step}]")
    row = DrillRow("guard_stop", step, "nonfinite", fired, message, None, f"{named} (left)")
    return row, problems


def _loaded(message: str) -> str | None:
    """The checkpoint (`step_N`) a `guard/rollback` message says it loaded."""
    return match.group(1) if (match := re.search(r"rolled back to \S*?(step_\d+)", message)) else None


def _best_evaluation(accumulator: EventAccumulator, before: float) -> int | None:
    """The step of the best `eval/reward_mean` (the first of equals) the run held at wall time `before`, as the
    trainer keeps it: every evaluation logged until then, less those a rollback forgot — an evaluation at a step
    past the checkpoint an earlier rollback loaded went with the iterations it passed over
    (`GuardResponses.roll_back`)."""
    timeline = [(e.wall_time, "eval", e.step, e.value) for e in accumulator.Scalars("eval/reward_mean")]
    timeline += [(e.wall_time, "rollback", e.step, tensor_util.make_ndarray(e.tensor_proto).reshape(-1)[0].decode())
                 for e in accumulator.Tensors("guard/rollback/text_summary")]  # fmt: skip
    held: list[tuple[int, float]] = []
    for wall_time, kind, step, value in sorted(timeline, key=lambda event: event[0]):
        if kind == "eval" and wall_time <= before:
            held.append((step, value))
        elif kind == "rollback" and wall_time < before and (loaded := _loaded(value)) is not None:  # not its own
            held = [(s, v) for s, v in held if s <= int(loaded.removeprefix("step_"))]
    best = None
    for step, value in held:
        if best is None or value > best[1]:
            best = (step, value)
    return None if best is None else best[0]


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
    columns = ("fault", "injected at step", "guard", "fired at step", "action", "checkpoint loaded",
               "recovered by step", f"{UPDATE_KL} after")  # fmt: skip
    for column in columns:
        table.add_column(column, justify="left" if column in ("fault", "guard", "action", columns[5]) else "right")
    for row in rows:
        table.add_row(row.fault, str(row.injected), row.guard, ", ".join(map(str, row.fired_at)) or "—",
                      row.action, row.loaded or "—", "—" if row.recovered_by is None else str(row.recovered_by),
                      "—" if row.kl_after is None else f"{row.kl_after:.3g}")  # fmt: skip
    table.caption = (f"held-out accuracy: SFT start {summary['accuracy_before']:.3f} → after PPO "
                     f"{summary['accuracy_after']:.3f}. Recovered by: the first later iteration no guard corrected "
                     "(after a rollback, step numbers restart at the checkpoint's).")  # fmt: skip
    Console(width=200).print(table)
