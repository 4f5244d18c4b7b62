"""The run's report where its tracker keeps it: after each job of a run that logs to MLflow, `report`'s summary
(`summary.txt`) and figure (`run.png`, `report --plot`, with the plot extra) as artifacts of the run's MLflow run.
Both are drawn from the run's TensorBoard files once the job's logger has closed them (so only with `tensorboard`
in `trainer.logger` too), which is why the command line adds them after the job (`cli._train`), on the process
that logged (`metrics_mlflow.finished_run`: none where MLflow was off, unreachable or failed)."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

from rich.console import Console

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.runs.figure import PlotError, plot_runs
from megatron_ppo.runs.report import find_runs, print_report
from megatron_ppo.train.metrics_mlflow import finished_run, warn


def run_summary(tensorboard_dir: Path) -> str:
    """`report`'s tables of the run, as text."""
    text = io.StringIO()
    print_report(tensorboard_dir, Console(file=text, width=160, color_system=None))
    return text.getvalue()


def publish_report(config: PPOConfig) -> None:
    """The summary and figure of the run this process just logged to MLflow, as its artifacts (module docstring);
    a failure is one warning line."""
    logged = finished_run()
    if logged is None or "tensorboard" not in config.trainer.logger:
        return
    try:
        folder = find_runs(config.trainer.log_dir)[-1]  # the run written most recently: this job's
        logged.client.log_text(logged.run_id, run_summary(folder), "summary.txt")
        with tempfile.TemporaryDirectory() as scratch:
            try:
                figure = plot_runs([folder], Path(scratch) / "run.png")
            except PlotError:  # no matplotlib (the plot extra): the summary alone
                return
            logged.client.log_artifact(logged.run_id, str(figure))
    except Exception as error:  # the tracker never fails the job
        warn(f"could not add the run's summary and figure ({type(error).__name__}: {error})")
