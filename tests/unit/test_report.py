"""`report` reads real TensorBoard event files (written by TensorBoard's own writer) back into one table."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console
from torch.utils.tensorboard import SummaryWriter

from megatron_ppo.cli import main
from megatron_ppo.report import print_report, read_run


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


def test_a_missing_directory_is_named() -> None:
    with pytest.raises(FileNotFoundError, match="no TensorBoard directory at /nonexistent"):
        read_run("/nonexistent")


def test_the_cli_names_a_run_that_has_not_started(tmp_path: Path, capsys) -> None:
    recipe = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml")
    assert main(["report", recipe, f"trainer.log_dir={tmp_path}/never"]) == 1
    assert f"no TensorBoard directory at {tmp_path}/never" in capsys.readouterr().err
