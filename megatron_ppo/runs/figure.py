"""`report --plot`: a picture of one or more runs on one shared step axis, read back from their TensorBoard folders.

    python -m megatron_ppo report outputs/tiny/tensorboard --plot run.png
    python -m megatron_ppo report RUN_A RUN_B RUN_C --plot three.png          (overlaid, each named)

Four panels, top to bottom:
- KL per token: every measured `kl/*` series (`kl/mean`, and any other per-token KL a run logs), the target each
  step was held to (dashed, as steps) with the ±10 % tracking band around it (`TRACKING_BAND`, shaded) and the
  band where its controller has one (shaded again), the stage boundaries and names, and β of each KL term on the
  right-hand axis;
- reward: the training batch's `reward/mean` and every held-out `eval/*` at each evaluation;
- gradient norms before clipping: each role's largest of the iteration (`actor/grad_norm_max`, what the guard
  judges) and mean (`actor/grad_norm`), with `guards.grad_norm_threshold`;
- events: a lane per run and guard that fired, named by the guard, with a marker at each step it fired (a rollback
  with an arrow back to the step the run went on from), a lane of checkpoint ticks per run, and marks given by the
  caller (the drill's injected faults). Values an iteration logged before a rollback abandoned it are crosses.

The targets, bands, stages and thresholds are what the run's own config says through the KL schedule code: the
trainer writes `run.json` (its resolved config and planned steps, `run_identity.py`) beside its event files, and
`build_kl_coefficients` turns it into the controllers the run used. A run without `run.json` is drawn without them.
Every drawn artist carries a gid `<run>|<what>` (`run|kl/mean`, `run|target`, `run|guard/rollback`, …).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ppo.algo import StagedKLSchedule, build_kl_controller
from megatron_ppo.checkpoint.run_identity import RunIdentity, unflatten_config
from megatron_ppo.config.errors import UserError
from megatron_ppo.runs.report import RunLog, load_run
from megatron_ppo.train.guards import ROLE_LOSSES
from megatron_ppo.train.kl_coefficients import (
    COEF_METRICS,
    STAGE_METRIC,
    TARGET_METRIC,
    TRACKING_BAND,
    TRACKING_METRIC,
    build_kl_coefficients,
)

PLOT_EXTRA = "pip install 'megatron-ppo[plot]'"
FORMATS = (".png", ".pdf", ".svg")
TRAIN_REWARD = "reward/mean"  # the training batch's reward: written once by every iteration
# per role, before clipping: the largest of the iteration's optimizer steps (what the grad-norm guard judges) and
# their mean (verl's `actor/grad_norm`)
GRAD_NORMS = {role: (f"{role}/grad_norm_max", f"{role}/grad_norm") for role in ROLE_LOSSES}
CHECKPOINT_EVENT = "checkpoint"
GUARD_PREFIX = "guard/"
ROLLBACK = "guard/rollback"
NAN = float("nan")
ABANDONED = {"linestyle": "none", "marker": "x", "markersize": 7, "markeredgewidth": 1.5}
SPREADS = ("std", "stderr")  # endings of the spread tags beside a KL series (not KLs themselves)
OTHER_KL_STYLES = ("-.", (0, (3, 1, 1, 1, 1, 1)), (0, (1, 1)))  # per-token KL series other than kl/mean


class PlotError(UserError):
    """A figure that cannot be drawn as asked (matplotlib missing, a file type it cannot write): the fix is named."""


@dataclass(frozen=True)
class Schedule:
    """What applied at each logged step n = 1 … total_steps, from the run's config and its KL controllers.

    The metrics of iteration n are logged at step n. Its β and target are the controller's before its update
    (stage of step n − 1); the guards then judge it under the thresholds of the stage the update moved to (step n)."""

    steps: list[int]
    target_kl: list[float]  # NaN where there is none (warm-up, fixed β)
    band: list[tuple[float, float]]  # (NaN, NaN) where the controller has no band
    grad_norm_threshold: list[float]  # NaN where off
    stages: list[tuple[str, int, int]]  # (name, first, last logged step) of each stage that has steps


@dataclass(frozen=True)
class PlottedRun:
    name: str
    log: RunLog
    schedule: Schedule | None  # None: the run left no run.json


def schedule_of(identity: RunIdentity) -> Schedule | None:
    """The run's targets, bands, stages and grad-norm thresholds per logged step (see `Schedule`); None when the
    identity holds no planned steps (a checkpoint's copy). With two KL terms the one logged last as `kl/target`
    (reward after loss) gives the target, as in the log."""
    if identity.total_steps is None:
        return None
    config = unflatten_config(identity.config)
    total = identity.total_steps
    steps = list(range(1, total + 1))
    base = config.guards.grad_norm_threshold
    threshold = [NAN if base is None else float(base)] * total
    controllers = [c for c in build_kl_coefficients(config, total).values() if c.target_kl is not None or
                   isinstance(c, StagedKLSchedule)]  # fmt: skip
    if not controllers:
        return Schedule(steps, [NAN] * total, [(NAN, NAN)] * total, threshold, [])
    controller = controllers[-1]
    if not isinstance(controller, StagedKLSchedule):
        band = getattr(controller, "band", (NAN, NAN))
        return Schedule(steps, [controller.target_kl] * total, [band] * total, threshold, [])
    targets, bands, thresholds = [], [], []
    for n in steps:
        stage = controller.stages[controller.stage_index_at(n - 1)]
        targets.append(NAN if stage.target_kl is None else stage.target_kl)
        bands.append(_stage_band(stage.controller, stage.target_kl, stage.band))
        judged = controller.stages[controller.stage_index_at(n)].guards.get("grad_norm_threshold", base)
        thresholds.append(NAN if judged is None else float(judged))
    stages = []
    for index, stage in enumerate(controller.stages):
        owned = [n for n in steps if controller.stage_index_at(n - 1) == index]
        if owned:
            stages.append((stage.name, owned[0], owned[-1]))
    return Schedule(steps, targets, bands, thresholds, stages)


def _stage_band(kind: str, target_kl: float | None, band: tuple[float, float] | None) -> tuple[float, float]:
    """The band a stage's controller holds KL in (the band rule's, default [t/1.5, 1.5·t]); (NaN, NaN) for others."""
    if kind != "band":
        return NAN, NAN
    return build_kl_controller("band", 1.0, target_kl=target_kl, band=band).band


def rollbacks(log: RunLog) -> list[tuple[int, int]]:
    """(step it fired at, step the run went on from) of each rollback done. The trainer writes the `guard/rollback`
    scalar only when it restored a checkpoint; the run then goes on from the checkpoint's step s, so the lowest step
    an iteration logs before the next rollback is s + 1 (the iteration that fired logs at its own number, ≥ s + 1)."""
    done = log.writes.get(ROLLBACK, [])
    iterations = log.writes.get(TRAIN_REWARD, [])
    out = []
    for index, (wall_time, fired, _) in enumerate(done):
        until = done[index + 1][0] if index + 1 < len(done) else math.inf
        after = [step for t, step, _ in iterations if wall_time < t < until]
        if after:
            out.append((fired, min(after) - 1))
    return out


def read_runs(folders: Sequence[str | Path], names: Sequence[str] | None = None) -> list[PlottedRun]:
    """The runs to draw, in order: each TensorBoard folder a run's own or a log dir (its newest run), each named by
    `names` or else by its run folder (the run id)."""
    if names is not None and len(names) != len(folders):
        raise ValueError(f"{len(names)} names for {len(folders)} runs")
    runs = []
    for index, folder in enumerate(folders):
        log = load_run(folder)
        identity = RunIdentity.read(log.folder)
        schedule = schedule_of(identity) if identity is not None else None
        runs.append(PlottedRun(log.folder.name if names is None else names[index], log, schedule))
    return runs


def matplotlib_figure() -> Any:
    """matplotlib's `Figure` class; `PlotError` naming the extra to install when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise PlotError(f"report --plot draws with matplotlib, which is not installed: {PLOT_EXTRA}") from None
    return Figure


def kl_series(log: RunLog) -> list[str]:
    """The per-token KL tags a run logged: `kl/*` but the controller's own outputs (β, stage, target, tracking error)
    and spreads (`kl/std`, `kl/stderr`, the probe's `kl/probe_std`, `kl/probe_stderr`)."""
    controller = {*COEF_METRICS.values(), STAGE_METRIC, TARGET_METRIC, TRACKING_METRIC}
    return sorted(t for t in log.writes if t.startswith("kl/") and t not in controller and not t.endswith(SPREADS))


def figure(runs: Sequence[PlottedRun], marks: Sequence[tuple[int, str]] = (), title: str | None = None) -> Any:
    """The figure of `runs` (a matplotlib `Figure`, no pyplot state); `marks`: (step, label) drawn in the event row
    `injected`."""
    figure_class = matplotlib_figure()
    lanes = event_lanes(runs, marks)
    fig = figure_class(figsize=(11, 8.6 + 0.22 * len(lanes)), layout="constrained")
    kl_axis, reward_axis, grad_axis, event_axis = fig.subplots(
        4, 1, sharex=True, height_ratios=[3, 2, 2, 0.4 + 0.22 * len(lanes)]
    )
    beta_axis = kl_axis.twinx()
    colours = [f"C{i % 10}" for i in range(len(runs))]
    styles: dict[Any, dict[str, dict[str, Any]]] = {kl_axis: {}, beta_axis: {}, reward_axis: {}, grad_axis: {}}
    named_stages = next((run for run in runs if run.schedule is not None and run.schedule.stages), None)

    def line(axis: Any, run: PlottedRun, what: str, steps: Sequence[float], values: Sequence[float], colour: str,
             style: dict[str, Any], label: str) -> None:  # fmt: skip
        axis.plot(steps, values, color=colour, gid=f"{run.name}|{what}", **style)
        styles[axis].setdefault(label, style)

    def abandoned(axis: Any, run: PlottedRun, tag: str, colour: str) -> None:
        """The values of iterations a rollback abandoned (their steps ran again), as crosses."""
        points = run.log.superseded(tag)
        if points:
            line(axis, run, f"{tag} rolled back", [s for s, _ in points], [v for _, v in points], colour,
                 ABANDONED, "iteration a rollback abandoned")  # fmt: skip

    for run, colour in zip(runs, colours, strict=True):
        log = run.log
        others = iter(OTHER_KL_STYLES)
        for tag in kl_series(log):
            points = log.scalars(tag)
            style = {"linestyle": "-" if tag == "kl/mean" else next(others, "-."), "linewidth": 1.4}
            line(kl_axis, run, tag, list(points), list(points.values()), colour, style, tag)
            abandoned(kl_axis, run, tag, colour)
        for tag in COEF_METRICS.values():
            points = log.scalars(tag)
            if points:
                line(beta_axis, run, tag, list(points), list(points.values()), colour,
                     {"linestyle": ":", "linewidth": 1.2, "alpha": 0.8}, f"β {tag} (right)")  # fmt: skip
        if run.schedule is not None:
            _draw_schedule(kl_axis, grad_axis, run, colour, line, run is named_stages)
        train_reward = log.scalars(TRAIN_REWARD)
        if train_reward:
            line(reward_axis, run, TRAIN_REWARD, list(train_reward), list(train_reward.values()), colour,
                 {"linewidth": 1.0, "alpha": 0.7}, f"{TRAIN_REWARD} (training batch)")  # fmt: skip
        for index, tag in enumerate(sorted(t for t in log.writes if t.startswith("eval/"))):
            points = log.scalars(tag)
            marker = {"marker": "osD^v"[index % 5], "markersize": 6 + 2 * min(index, 1)}
            if index:  # hollow and larger, so that equal values (accuracy = reward on a 0/1 task) both show
                marker |= {"markerfacecolor": "none", "markeredgewidth": 1.3}
            line(reward_axis, run, tag, list(points), list(points.values()), colour,
                 {**marker, "linestyle": "--", "linewidth": 0.9}, f"{tag} (held out)")  # fmt: skip
        for (largest, mean), linestyle in zip(GRAD_NORMS.values(), ("-", "--"), strict=True):
            for tag, style in ((largest, {"linewidth": 1.3}), (mean, {"linewidth": 0.8, "alpha": 0.45})):
                points = log.scalars(tag)
                if points:
                    line(grad_axis, run, tag, list(points), list(points.values()), colour,
                         {"linestyle": linestyle, **style}, tag)  # fmt: skip
            abandoned(grad_axis, run, largest, colour)
    rows = _draw_events(event_axis, runs, colours, marks, lanes)
    _keep_in_view(kl_axis)
    kl_axis.set_ylabel("KL per token (nats)")
    beta_axis.set_ylabel("β (KL coefficient)")
    reward_axis.set_ylabel("reward / accuracy")
    grad_axis.set_ylabel("grad norm (before clipping)")
    if any(v > 0 for line_ in grad_axis.lines for v in line_.get_ydata() if math.isfinite(v)):
        grad_axis.set_yscale("log")
    event_axis.set_yticks(range(len(rows)), rows, fontsize=7)
    event_axis.set_ylim(-0.7, len(rows) - 0.3)
    event_axis.set_xlabel("step")
    for axis in (kl_axis, reward_axis, grad_axis, event_axis):
        axis.grid(alpha=0.25)
    for axis in (kl_axis, reward_axis, grad_axis):
        handles = [_proxy(style, label) for label, style in styles[axis].items()]
        if axis is kl_axis:
            handles += [_proxy(style, label) for label, style in styles[beta_axis].items()]
        if handles:
            axis.legend(handles=handles, loc="best", fontsize=7, ncol=2 if len(handles) > 4 else 1)
    if len(runs) > 1:
        from matplotlib.lines import Line2D

        fig.legend(handles=[Line2D([], [], color=c, linewidth=3, label=run.name) for run, c in zip(runs, colours,
                   strict=True)], loc="outside lower center", ncol=min(len(runs), 6), fontsize=8)  # fmt: skip
    missing = [run.name for run in runs if run.schedule is None]
    note = f" — no run.json for {', '.join(missing)}: its KL targets and thresholds are not drawn" if missing else ""
    fig.suptitle((title or ", ".join(run.name for run in runs)) + note, fontsize=10)
    return fig


def _draw_schedule(kl_axis: Any, grad_axis: Any, run: PlottedRun, colour: str, line: Any, name_stages: bool) -> None:
    schedule = run.schedule
    banded = False
    for first, last, (low, high) in _runs_of_equal(schedule.steps, schedule.band):
        if math.isfinite(low):  # a step's band covers [n − ½, n + ½], as the steps-mid lines do
            kl_axis.fill_between([first - 0.5, last + 0.5], low, high, color=colour, alpha=0.12, linewidth=0,
                                 gid=f"{run.name}|band")  # fmt: skip
            banded = True
    for first, last, target in _runs_of_equal(schedule.steps, schedule.target_kl):
        if math.isfinite(target):
            kl_axis.fill_between([first - 0.5, last + 0.5], target * (1 - TRACKING_BAND), target * (1 + TRACKING_BAND),
                                 color=colour, alpha=0.16, linewidth=0,
                                 gid=f"{run.name}|tracking band")  # fmt: skip
    if any(math.isfinite(v) for v in schedule.target_kl):
        label = "target, ±10 % shaded" + (", its rule's band darker" if banded else "")
        line(kl_axis, run, "target", schedule.steps, schedule.target_kl, colour,
             {"linestyle": "--", "linewidth": 1.6, "drawstyle": "steps-mid"}, label)  # fmt: skip
    if any(math.isfinite(v) for v in schedule.grad_norm_threshold):
        line(grad_axis, run, "grad_norm_threshold", schedule.steps, schedule.grad_norm_threshold, colour,
             {"linestyle": (0, (6, 2, 1, 2)), "linewidth": 1.4, "drawstyle": "steps-mid"},
             "guards.grad_norm_threshold")  # fmt: skip
    for index, (name, first, last) in enumerate(schedule.stages):
        if index:
            kl_axis.axvline(first - 0.5, color=colour, alpha=0.4, linewidth=0.8, gid=f"{run.name}|stage {name}")
        if name_stages:
            kl_axis.text((first + last) / 2, 1.0, name, transform=kl_axis.get_xaxis_transform(), ha="center",
                         va="bottom", fontsize=8, color="0.3")  # fmt: skip


def _keep_in_view(axis: Any) -> None:
    """Scale `axis` to its kept series and targets; a rolled-back value far above them (a KL blow-up) is drawn at
    the top edge with its value written beside it, so that it neither flattens the rest nor goes unseen."""
    crosses = [line_ for line_ in axis.lines if (line_.get_gid() or "").endswith(" rolled back")]
    kept = [v for line_ in axis.lines if line_ not in crosses for v in line_.get_ydata() if math.isfinite(v)]
    if not kept or not crosses:
        return
    low, high = min(0.0, min(kept)), 1.15 * max(kept)
    if not any(v > high for line_ in crosses for v in line_.get_ydata()):
        return
    axis.set_ylim(low, high)
    for line_ in crosses:
        xs, ys = list(line_.get_xdata()), list(line_.get_ydata())
        line_.set_ydata([min(y, 0.97 * high) for y in ys])
        for x, y in zip(xs, ys, strict=True):
            if y > high:
                axis.annotate(f"{y:.3g}", (x, 0.97 * high), xytext=(5, -3), textcoords="offset points", fontsize=7,
                              color=line_.get_color())  # fmt: skip


def _runs_of_equal(steps: Sequence[int], values: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """(first step, last step, value) of each run of consecutive equal values."""
    out: list[tuple[int, int, Any]] = []
    for step, value in zip(steps, values, strict=True):
        if out and out[-1][2] == value:
            out[-1] = (out[-1][0], step, value)
        else:
            out.append((step, step, value))
    return out


def event_lanes(runs: Sequence[PlottedRun], marks: Sequence[tuple[int, str]]) -> list[tuple[PlottedRun | None, str]]:
    """The rows of the event panel, bottom up: per run its checkpoints, then each guard that fired (by name); the
    caller's marks (run None) on top."""
    lanes: list[tuple[PlottedRun | None, str]] = []
    for run in runs:
        tags = {e.tag for e in run.log.events if e.tag == CHECKPOINT_EVENT or e.tag.startswith(GUARD_PREFIX)}
        lanes += [(run, tag) for tag in sorted(tags, key=lambda t: (t != CHECKPOINT_EVENT, t))]
    return lanes + ([(None, "injected")] if marks else [])


def _draw_events(axis: Any, runs: Sequence[PlottedRun], colours: Sequence[str], marks: Sequence[tuple[int, str]],
                 lanes: list[tuple[PlottedRun | None, str]]) -> list[str]:  # fmt: skip
    """A lane per (run, event kind): a marker at each step it was logged at (×n where a rerun after a rollback logged
    it again), a rollback with an arrow back to the step the run went on from (hollow: not done); returns the lane
    names."""
    colour_of = {run.name: colour for run, colour in zip(runs, colours, strict=True)}
    names = []
    for lane, (run, tag) in enumerate(lanes):
        name = tag.removeprefix(GUARD_PREFIX) if tag != CHECKPOINT_EVENT else "checkpoints"
        names.append(name if len(runs) == 1 or run is None else f"{run.name} · {name}")
        if run is None:
            steps = [step for step, _ in marks]
            axis.plot(steps, [lane] * len(steps), linestyle="none", marker="v", markersize=7, color="crimson",
                      gid="injected")  # fmt: skip
            for step, label in marks:
                axis.annotate(label, (step, lane), xytext=(0, 6), textcoords="offset points", fontsize=6.5,
                              ha="center", color="crimson")  # fmt: skip
            continue
        colour, times = colour_of[run.name], Counter(e.step for e in run.log.events if e.tag == tag)
        steps = sorted(times)
        for step in steps:
            if times[step] > 1:
                axis.annotate(f"×{times[step]}", (step, lane), xytext=(0, 5), textcoords="offset points", fontsize=6,
                              ha="center")  # fmt: skip
        if tag == CHECKPOINT_EVENT:
            axis.plot(steps, [lane] * len(steps), linestyle="none", marker="|", markersize=11, markeredgewidth=1.5,
                      color=colour, gid=f"{run.name}|{tag}")  # fmt: skip
            continue
        axis.plot(steps, [lane] * len(steps), linestyle="none", marker="o", markersize=5, color=colour,
                  gid=f"{run.name}|{tag}")  # fmt: skip
        returns = rollbacks(run.log) if tag == ROLLBACK else []
        refused = [step for step in steps if tag == ROLLBACK and step not in {fired for fired, _ in returns}]
        if refused:  # nothing to return to yet: drawn hollow
            axis.plot(refused, [lane] * len(refused), linestyle="none", marker="o", markersize=5,
                      markerfacecolor="white", markeredgecolor=colour, gid=f"{run.name}|rollback not done")  # fmt: skip
        for fired, returned in returns:
            arrow = {"arrowstyle": "->", "color": colour, "connectionstyle": "arc3,rad=-0.25"}
            axis.annotate("", xy=(returned, lane), xytext=(fired, lane), gid=f"{run.name}|rollback",
                          arrowprops=arrow)  # fmt: skip
    return names


def _proxy(style: dict[str, Any], label: str) -> Any:
    from matplotlib.lines import Line2D

    return Line2D([], [], color="0.2", label=label, **{k: v for k, v in style.items() if k != "drawstyle"})


def default_path(runs: Sequence[PlottedRun]) -> Path:
    """Beside the first run's folder: `<trainer.log_dir>/<run id>.png`."""
    folder = runs[0].log.folder
    return folder.parent / f"{folder.name}.png"


def plot_runs(folders: Sequence[str | Path], path: str | Path | None = None, *, names: Sequence[str] | None = None,
              marks: Sequence[tuple[int, str]] = (), title: str | None = None) -> Path:  # fmt: skip
    """Draw the runs of `folders` (see `read_runs`) into `path` (default: `default_path`); returns the path."""
    if path is not None and Path(path).suffix not in FORMATS:
        raise PlotError(f"--plot {path}: the figure is written as {', '.join(FORMATS)}; name a file ending so")
    matplotlib_figure()  # before any reading: a missing extra is named at once
    runs = read_runs(folders, names)
    path = Path(path) if path is not None else default_path(runs)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure(runs, marks, title).savefig(path, dpi=80)
    return path
