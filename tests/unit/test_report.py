"""`report` reads real TensorBoard event files (written by TensorBoard's own writer) back into one table."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console
from torch.utils.tensorboard import SummaryWriter

from megatron_ppo.cli import main
from megatron_ppo.runs.report import print_report, read_run


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    writer = SummaryWriter(str(tmp_path / "tb"))
    for step, loss in enumerate([0.5, 0.2, 0.9, 0.4], start=1):
        writer.add_scalar("actor/pg_loss", loss, step)
    writer.add_text("checkpoint", "saved step_2", 2)
    writer.add_scalar("actor/pg_loss", 0.1, 3)  # after a rollback, step 3 is written again: the last value wins
    writer.add_text("rollback", "KL 9.1 > 5.0: back to step_2, lr x 0.5", 3)
    writer.add_text("checkpoint", "resumed from step_2", 2)
    writer.close()
    return tmp_path / "tb"


def test_scalars_are_summarised_with_their_steps(run_dir: Path) -> None:
    (loss,), _ = read_run(run_dir)
    assert (loss.tag, loss.steps) == ("actor/pg_loss", 4)
    points = [loss.first, loss.last, loss.low, loss.high]
    assert [step for step, _ in points] == [1, 4, 3, 1]
    assert [value for _, value in points] == pytest.approx([0.5, 0.4, 0.1, 0.5])


def test_events_come_in_step_then_write_order(run_dir: Path) -> None:
    _, events = read_run(run_dir)
    assert [(e.step, e.tag, e.message) for e in events] == [
        (2, "checkpoint", "saved step_2"),
        (2, "checkpoint", "resumed from step_2"),
        (3, "rollback", "KL 9.1 > 5.0: back to step_2, lr x 0.5"),
    ]


def test_the_printed_report_and_the_cli(run_dir: Path, capsys) -> None:
    console = Console(record=True, width=200)
    print_report(run_dir, console)
    text = console.export_text()
    assert "actor/pg_loss" in text and "0.4 @4" in text and "back to step_2" in text
    assert main(["report", str(run_dir)]) == 0 and "rollback" in capsys.readouterr().out


def test_guard_events_by_kind_and_the_evaluation_history(tmp_path: Path) -> None:
    writer = SummaryWriter(str(tmp_path))
    writer.add_text("guard/grad_norm", "actor grad norm 7.1 > guards.grad_norm_threshold=5.0", 3)
    writer.add_text("guard/kl_explosion", "KL 0.04 > guards.kl_explosion_threshold=0.03: roll back", 5)
    writer.add_text("guard/grad_norm", "critic grad norm 9.9 > guards.grad_norm_threshold=5.0", 8)
    for step, reward in [(0, 0.25), (4, 0.5), (8, 0.4)]:
        writer.add_scalar("eval/reward_mean", reward, step)
    writer.add_scalar("eval/accuracy", 0.7, 4)
    writer.close()
    console = Console(record=True, width=200)
    print_report(tmp_path, console)
    text = console.export_text()
    by_kind = text[text.index("guard events by kind") : text.index("evaluations")]
    assert "grad_norm" in by_kind and "3, 8" in by_kind and "critic grad norm 9.9" in by_kind
    kl_row = next(line for line in by_kind.splitlines() if "kl_explosion" in line)
    assert [cell.strip() for cell in kl_row.split("│")[1:4]] == ["kl_explosion", "1", "5"], kl_row
    history = text[text.index("evaluations") :].splitlines()
    rows = [[cell.strip() for cell in line.split("│")[1:4]] for line in history if "│" in line]
    assert ["4", "0.7", "0.5"] in rows and ["8", "", "0.4"] in rows, rows


def test_a_missing_directory_is_named() -> None:
    with pytest.raises(FileNotFoundError, match="no TensorBoard directory at /nonexistent"):
        read_run("/nonexistent")


def test_the_cli_names_a_run_that_has_not_started(tmp_path: Path, capsys) -> None:
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml")
    assert main(["report", recipe, f"trainer.log_dir={tmp_path}/never"]) == 2
    assert f"no TensorBoard directory at {tmp_path}/never" in capsys.readouterr().err


def _run_folder(log_dir: Path, run_id: str, losses: list[float]) -> Path:
    writer = SummaryWriter(str(log_dir / run_id))
    for step, loss in enumerate(losses, start=1):
        writer.add_scalar("actor/pg_loss", loss, step)
    writer.add_text("run", f"new run {run_id}", 0)
    writer.close()
    return log_dir / run_id


def test_each_run_is_read_on_its_own_and_named(tmp_path: Path) -> None:
    """Two runs in one trainer.log_dir (each in its run-id folder): the report reads the one written last, whole and
    alone, names it, and lists the other; given a run's folder, it reads that run."""
    first = _run_folder(tmp_path, "20261201-000000-aaaaaa", [0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    second = _run_folder(tmp_path, "20261201-010000-bbbbbb", [0.3, 0.2, 0.1])
    os.utime(next(first.iterdir()), (1, 1))  # the first run's events are older, whatever the clock did
    (loss,), events = read_run(tmp_path)
    assert (loss.steps, loss.first, loss.last) == (3, (1, pytest.approx(0.3)), (3, pytest.approx(0.1)))
    assert [e.message for e in events] == ["new run 20261201-010000-bbbbbb"]
    console = Console(record=True, width=200)
    print_report(tmp_path, console)
    text = console.export_text()
    assert f"run {second.name}" in text
    assert "1 other run(s)" in text and "20261201-000000-aaaaaa" in text
    (loss,), _ = read_run(first)
    assert (loss.steps, loss.last) == (6, (6, pytest.approx(0.4)))


def test_a_log_dir_without_runs_is_named(tmp_path: Path) -> None:
    (tmp_path / "empty-run").mkdir()
    with pytest.raises(FileNotFoundError, match=f"no TensorBoard run in {tmp_path}"):
        read_run(tmp_path)


def test_a_wide_table_printed_into_a_log_keeps_its_cells_whole(capsys, monkeypatch) -> None:
    """Into a file or pipe (here pytest's capture) rich takes 80 columns and wraps eleven columns into cells of a few
    characters; `table_console` prints it whole, as at a wide terminal."""
    from rich.table import Table

    from megatron_ppo.runs.report import table_console

    monkeypatch.delenv("COLUMNS", raising=False)
    headers = ["KL control", "SFT start", "after PPO", "change", "KL within ±10 %", "on target: noise allows",
               "mean |KL/target − 1|", "max KL/target", "final KL/token", "final β",
               "TensorBoard run"]  # fmt: skip
    table = Table()
    for header in headers:
        table.add_column(header)
    table.add_row("staged-pi", "0.595", "0.920", "+0.325", "15/22 (68%)", "74%", "0.100", "1.42", "0.433", "0.227",
                  "staged-pi/tensorboard/20261205-131054-0a1b2c")  # fmt: skip
    table_console().print(table)
    out = capsys.readouterr().out
    assert all(header in out for header in headers), out
    assert "staged-pi/tensorboard/20261205-131054-0a1b2c" in out, out
