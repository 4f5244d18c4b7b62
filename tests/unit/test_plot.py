"""`report --plot`: a run logged through the trainer's own logger (`MetricsLogger`: TensorBoard's `SummaryWriter` and
`run.json`) with β, stage and target from the real KL controllers, guard events and rollbacks written in the
trainer's order; the figure's artists must carry exactly the logged scalars, the targets and thresholds that
applied at each step, and every guard event at its step."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ppo.cli import main
from megatron_ppo.config import load_config
from megatron_ppo.runs.figure import PlotError, figure, plot_runs, read_runs
from megatron_ppo.train.guards import Guards
from megatron_ppo.train.kl_coefficients import KLCoefficients
from megatron_ppo.train.metrics import MetricsLogger

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
TOTAL = 20
# warm-up 2 steps, then power law (target 0.2), a band stage with its own grad-norm threshold, power law (0.4)
STAGES = ("algorithm.kl_ctrl.stages=[{name: warmup, end: 0.1, controller: warmup}, {name: early, end: 0.3, "
          "target_kl: 0.2}, {name: mid, end: 0.7, controller: band, target_kl: 0.3, band: "
          "[0.25, 0.35], guards: {grad_norm_threshold: 20.0}}, {name: late, end: 1.0, target_kl: 0.4}]")  # fmt: skip
RUN = "20261201-000000-aaaaaa"


def _log_run(log_dir: Path, run_id: str, overrides: list[str]) -> dict[str, dict[int, float]]:
    """Write a 20-step run as the trainer does; returns tag → {step: value} as logged (last write wins) plus the
    thresholds the guards applied (`applied/grad_norm_threshold`) and the events (`event/<tag>`, step → count)."""
    config = load_config(TINY, [f"trainer.total_training_steps={TOTAL}", *overrides])
    logger = MetricsLogger(log_dir / run_id, ["tensorboard"], TOTAL, config=config, run_id=run_id)
    kl, guards = KLCoefficients(config, TOTAL), Guards(config.guards)
    logged: dict[str, dict[int, float]] = {}
    events: list[tuple[int, str]] = []

    def log(step: int, metrics: dict[str, float]) -> None:
        logger.log(step, metrics)
        for tag, value in metrics.items():
            logged.setdefault(tag, {})[step] = value

    def event(step: int, tag: str, message: str) -> None:
        logger.event(step, tag, message)
        events.append((step, tag))

    def evaluate(step: int) -> None:
        log(step, {"eval/reward_mean": 0.1 + 0.02 * step, "eval/accuracy": 0.5 + 0.01 * step})

    event(0, "run", f"new run {run_id}")
    evaluate(0)
    saved: dict[int, dict] = {}
    step, rolled_back = 0, set()
    while step < TOTAL:
        number = step + 1
        metrics = {"reward/mean": 0.3 + 0.01 * number, "kl/mean": 0.05 * number % 0.7, "kl/std": 0.01,
                   "kl/stderr": 0.001, "kl/probe_std": 0.02, "kl/probe_stderr": 0.002,
                   "kl/post_update_mean": 0.04 * number % 0.6, "actor/grad_norm": 3.0 + number,
                   "actor/grad_norm_max": 4.0 + number, "critic/grad_norm": 30.0 / number,
                   "critic/grad_norm_max": 40.0 / number}  # fmt: skip
        step = number
        metrics |= kl.step(metrics, 512)
        logged.setdefault("applied/grad_norm_threshold", {})[number] = guards.thresholds(
            kl.guard_overrides
        ).grad_norm_threshold  # what the trainer's guards judge this iteration by
        if number == 3:
            event(number, "guard/rollback", "rollback not possible: no checkpoint to return to yet; continuing")
        if number == 5:
            event(number, "guard/grad_norm", "actor grad norm 8 > 5: learning rate × 0.5")
            log(number, {"guard/grad_norm": 8.0})
        if number == 13 and 13 not in rolled_back:  # a KL explosion: back to the checkpoint of step 12
            rolled_back.add(13)
            metrics["kl/mean"] = 6.0
            for tag, value in (("guard/kl_explosion", 2.0), ("guard/kl_bump", 2.0)):
                event(number, tag, f"KL {value} > threshold")
                log(number, {tag: value})
            kl.load_state_dict(saved[12])
            step = 12
            event(number, "guard/rollback", "rolled back to step_12; the run continues from step 12")
            log(number, {"guard/rollback": 1.0})
        log(number, metrics)
        if step == number and step % 4 == 0:
            evaluate(step)
            if step == 16 and 16 not in rolled_back:  # an evaluation drop: back to the best (step 8)
                rolled_back.add(16)
                event(16, "guard/eval_drop", "eval/reward_mean dropped")
                log(16, {"guard/eval_drop": 0.1})
                kl.load_state_dict(saved[8])
                step = 8
                event(16, "guard/rollback", "rolled back to step_8; the run continues from step 8")
                log(16, {"guard/rollback": 2.0})
            else:
                saved[step] = kl.state_dict()
                event(step, "checkpoint", f"saved step_{step}")
    logger.close()
    for at, tag in events:
        counts = logged.setdefault(f"event/{tag}", {})
        counts[at] = counts.get(at, 0) + 1
    return logged


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> tuple[Path, dict[str, dict[int, float]]]:
    log_dir = tmp_path_factory.mktemp("tb")
    return log_dir, _log_run(log_dir, RUN, [STAGES])


def _line(fig, gid: str):
    (line,) = [line for axis in fig.axes for line in axis.lines if line.get_gid() == gid]
    return {float(x): float(y) for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)}


def _event_axis(fig):
    (axis,) = [axis for axis in fig.axes if axis.get_xlabel() == "step"]
    return axis


def test_every_series_is_drawn_as_logged(staged) -> None:
    log_dir, logged = staged
    fig = figure(read_runs([log_dir]))
    for tag in ("kl/mean", "kl/post_update_mean", "kl/coef", "reward/mean", "eval/reward_mean", "eval/accuracy",
                "actor/grad_norm", "actor/grad_norm_max", "critic/grad_norm", "critic/grad_norm_max"):  # fmt: skip
        assert _line(fig, f"{RUN}|{tag}") == pytest.approx(logged[tag], rel=1e-6), tag
    drawn = {line.get_gid() for axis in fig.axes for line in axis.lines}
    spreads_and_settings = ("kl/std", "kl/stderr", "kl/probe_std", "kl/probe_stderr", "kl/stage", "kl/target")
    assert not drawn & {f"{RUN}|{tag}" for tag in spreads_and_settings}, "not per-token KL series"


def test_iterations_a_rollback_abandoned_are_crosses_and_a_blowup_stays_in_view(staged) -> None:
    log_dir, logged = staged
    fig = figure(read_runs([log_dir]))
    kl_axis = fig.axes[0]
    (line,) = [line for line in kl_axis.lines if line.get_gid() == f"{RUN}|kl/mean rolled back"]
    crosses = sorted(zip(line.get_xdata(), line.get_ydata(), strict=True))
    # the blown-up first pass of 13 (rolled back to 12), then 9–16 (rolled back to 8 by the evaluation drop)
    assert [x for x, _ in crosses] == [9, 10, 11, 12, 13, 13, 14, 15, 16]
    top = kl_axis.get_ylim()[1]
    assert top < 6.0 and max(y for _, y in crosses) == pytest.approx(0.97 * top), "the blow-up at the top edge"
    assert "6" in {t.get_text() for t in kl_axis.texts}, "with its value beside it"
    kept = [(x, y) for x, y in crosses if y < 0.97 * top]
    assert [y for _, y in kept] == pytest.approx([logged["kl/mean"][x] for x, _ in kept], rel=1e-6)


def test_targets_bands_and_thresholds_are_the_ones_that_applied(staged) -> None:
    log_dir, logged = staged
    fig = figure(read_runs([log_dir]))
    target = _line(fig, f"{RUN}|target")
    assert set(target) == set(range(1, TOTAL + 1))
    for step, value in target.items():
        if step in logged["kl/target"]:
            assert value == pytest.approx(logged["kl/target"][step], rel=1e-12), step
        else:  # the warm-up: β ramps in, no target
            assert math.isnan(value) and step <= 2, step
    threshold = _line(fig, f"{RUN}|grad_norm_threshold")
    assert threshold == logged["applied/grad_norm_threshold"]
    assert {threshold[n] for n in range(7, 14)} == {20.0} and threshold[14] == threshold[1] == 50.0
    (band,) = [c for axis in fig.axes for c in axis.collections if c.get_gid() == f"{RUN}|band"]
    corners = {(round(x, 6), round(y, 6)) for path in band.get_paths() for x, y in path.vertices}
    assert {y for _, y in corners} == {0.25, 0.35}, "only the band stage has a band"
    assert min(x for x, _ in corners) == 6.5 and max(x for x, _ in corners) == 14.5, "steps 7–14 (stage 'mid')"
    tracking = [c for axis in fig.axes for c in axis.collections if c.get_gid() == f"{RUN}|tracking band"]
    edges = {round(y, 6) for c in tracking for path in c.get_paths() for _, y in path.vertices}
    assert edges == {0.18, 0.22, 0.27, 0.33, 0.36, 0.44}, "±10 % around each stage's target"


def test_each_guard_event_and_checkpoint_is_drawn_at_its_step(staged) -> None:
    log_dir, logged = staged
    fig = figure(read_runs([log_dir]))
    for tag in ("guard/grad_norm", "guard/kl_explosion", "guard/kl_bump", "guard/eval_drop", "guard/rollback",
                "checkpoint"):  # fmt: skip
        (line,) = [line for axis in fig.axes for line in axis.lines if line.get_gid() == f"{RUN}|{tag}"]
        assert list(line.get_xdata()) == sorted(logged[f"event/{tag}"]), tag
        (lane,) = set(line.get_ydata())
        lanes = _event_axis(fig).get_yticklabels()  # a lane per kind, named
        assert lanes[int(lane)].get_text() == ("checkpoints" if tag == "checkpoint" else tag.removeprefix("guard/"))
    arrows = [text for axis in fig.axes for text in axis.texts if text.get_gid() == f"{RUN}|rollback"]
    assert sorted((a.xyann[0], a.xy[0]) for a in arrows) == [(13, 12), (16, 8)], "no arrow for the refused one"
    assert list(_line(fig, f"{RUN}|rollback not done")) == [3.0]
    rerun = {t.get_text() for axis in fig.axes for t in axis.texts if getattr(t, "xy", (None,))[0] == 12}
    assert "×2" in rerun, "step 12's checkpoint was saved again after the eval-drop rollback to step 8"
    assert {"early", "mid", "late"} <= {text.get_text() for text in fig.axes[0].texts}


def test_runs_overlay_each_named_and_the_cli_writes_the_file(staged, tmp_path: Path, capsys) -> None:
    log_dir, _ = staged
    other = "20261201-010000-bbbbbb"
    fixed = _log_run(tmp_path / "fixed", other, ["algorithm.kl_ctrl.type=fixed", "algorithm.kl_ctrl.stages=[]"])
    fig = figure(read_runs([log_dir, tmp_path / "fixed"], names=["staged", "fixed"]))
    assert _line(fig, "fixed|kl/mean") == pytest.approx(fixed["kl/mean"], rel=1e-6)
    assert not [line for axis in fig.axes for line in axis.lines if line.get_gid() == "fixed|target"]
    assert {t.get_text() for legend in fig.legends for t in legend.get_texts()} == {"staged", "fixed"}
    out = tmp_path / "figure.png"
    assert main(["report", str(log_dir / RUN), str(tmp_path / "fixed"), "--plot", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"figure: {out}" and out.read_bytes()[:4] == b"\x89PNG"
    assert main(["report", str(log_dir), "--plot"]) == 0, "the default: beside the run's folder"
    assert (log_dir / f"{RUN}.png").is_file() and str(log_dir / f"{RUN}.png") in capsys.readouterr().out
    assert main(["report", str(log_dir), "--plot", str(tmp_path / "figure.txt")]) == 2
    assert "name a file ending so" in capsys.readouterr().err


def test_a_run_without_run_json_is_drawn_without_its_schedule(staged, tmp_path: Path) -> None:
    log_dir, logged = staged
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in (log_dir / RUN).glob("events.out.tfevents.*"):
        (copy / path.name).write_bytes(path.read_bytes())
    fig = figure(read_runs([copy]))
    assert _line(fig, "copy|kl/mean") == pytest.approx(logged["kl/mean"], rel=1e-6)
    assert not [line for axis in fig.axes for line in axis.lines if line.get_gid() == "copy|target"]
    assert "no run.json for copy" in fig._suptitle.get_text()


def test_marks_are_drawn_in_their_own_row(staged) -> None:
    log_dir, _ = staged
    fig = figure(read_runs([log_dir]), marks=[(3, "nan_gradient"), (12, "kl_blowup")])
    assert list(_line(fig, "injected")) == [3.0, 12.0]
    assert {"nan_gradient", "kl_blowup"} <= {text.get_text() for axis in fig.axes for text in axis.texts}
    assert _event_axis(fig).get_yticklabels()[-1].get_text() == "injected"


def test_missing_matplotlib_names_the_extra(staged, monkeypatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "matplotlib.figure", None)  # what `import` sees when absent
    with pytest.raises(PlotError, match=r"pip install 'megatron-ppo\[plot\]'"):
        plot_runs([staged[0]])


def test_report_and_its_figure_read_a_run_without_importing_megatron_core(staged, tmp_path: Path) -> None:
    """`report` and `report --plot` read TensorBoard files and `run.json` only: on a login node, or beside a run,
    they answer in ~2 s, without megatron-core's ~4 s import (the KL probe's metric names once brought it in)."""
    log_dir, _ = staged
    out = tmp_path / "figure.png"
    probe = ("import sys; from megatron_ppo.cli import main; code = main(sys.argv[1:]); "
             "sys.exit(code or 3 * ('megatron.core' in sys.modules))")  # fmt: skip
    for command in (["report", str(log_dir / RUN)], ["report", str(log_dir / RUN), "--plot", str(out)]):
        result = subprocess.run([sys.executable, "-c", probe, *command], capture_output=True, text=True, check=False)
        assert result.returncode == 0, (
            f"{command[0]}: exit {result.returncode} (3: megatron.core was imported)\n" + (result.stderr[-2000:])
        )
    assert out.read_bytes()[:4] == b"\x89PNG"
