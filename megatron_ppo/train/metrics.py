"""Metrics: TensorBoard event files, the console and (optional) Weights & Biases and MLflow, written by global rank 0
only."""

from __future__ import annotations

import dataclasses
import errno
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.tensorboard import SummaryWriter

from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.config.errors import UserError
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.train.metrics_mlflow import MlflowLogger

CONSOLE_KEYS = (
    "reward/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "kl/mean",
    "kl/probe_mean",
    "kl/coef",
    "critic/vf_loss",
    "actor/grad_norm",
)


class LogWriteError(UserError):
    """The run's logs cannot be written (`trainer.log_dir`): a full disk above all."""


def leave_tensorboard_write_errors_to_the_logger() -> None:
    """TensorBoard's writer thread re-raises a write the filesystem refused, which `threading` prints as a traceback
    of its own; the logger reports it (`LogWriteError`, once) at its next write, so the thread's is not printed.
    Installed once per process; every other thread's error is printed as before."""
    previous = threading.excepthook
    if getattr(previous, "__name__", "") == "_reported_by_the_logger":
        return

    def _reported_by_the_logger(args: threading.ExceptHookArgs) -> None:
        if not (isinstance(args.exc_value, OSError) and type(args.thread).__module__.startswith("tensorboard.")):
            previous(args)

    threading.excepthook = _reported_by_the_logger


def is_logging_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricsLogger:
    """Scalars to `log_dir` (TensorBoard), W&B and MLflow under the same names, and a one-line summary plus a
    progress bar with ETA on the console.

    The trainer passes its run's own folder, `<trainer.log_dir>/<run id>` (`checkpoint/run_start.py`), so event files of
    two runs never mix; a resumed run appends to its folder, and a step written again wins in `report`.
    W&B (`wandb` in `loggers`): the run is `config.trainer.project_name` / `experiment_name`, its config the resolved
    config, its id the run id (a resumed run continues it), its files under `log_dir/wandb`; `WANDB_MODE=offline`
    keeps them there. W&B keeps the first value of a step: the steps a rollback repeats stay as first logged there.
    Events (`event`) are TensorBoard text and console lines; W&B records them with the console output when
    `console` is on. MLflow (`mlflow` in `loggers`): `metrics_mlflow.py`. Beside the event files, `run.json` holds
    the run's identity, resolved config and planned steps (written at each job's start), from which `report --plot`
    draws the KL stages and guard thresholds."""

    def __init__(
        self,
        log_dir: str | Path,
        loggers: list[str],
        total_steps: int,
        description: str = "ppo",
        config: PPOConfig | None = None,
        run_id: str | None = None,
    ) -> None:
        self.enabled = is_logging_rank()
        self.log_dir = Path(log_dir)
        self.console = Console(stderr=True)
        self.writer = SummaryWriter(str(log_dir)) if self.enabled and "tensorboard" in loggers else None
        if self.writer is not None:
            leave_tensorboard_write_errors_to_the_logger()
        if self.writer is not None and config is not None and run_id is not None:
            RunIdentity.of(run_id, config, total_steps).write(log_dir)
        self.wandb = _start_wandb(Path(log_dir), config, run_id) if self.enabled and "wandb" in loggers else None
        self.mlflow = (
            _start_mlflow(Path(log_dir), config, run_id, total_steps) if self.enabled and "mlflow" in loggers else None
        )
        self.to_console = self.enabled and "console" in loggers
        self.progress = None
        if self.to_console:
            self.progress = Progress(
                TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), console=self.console, transient=False,
            )  # fmt: skip
            self.progress.start()
            self.task = self.progress.add_task(description, total=total_steps)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        if self.writer is not None:
            self._to_tensorboard(lambda writer: [writer.add_scalar(k, v, step) for k, v in metrics.items()])
        if self.wandb is not None:
            self.wandb.log(dict(metrics), step=step)
        if self.mlflow is not None:
            self.mlflow.log(step, metrics)
        if self.to_console:
            shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
            if shown:  # a guard's or an evaluation's scalars alone have their own event line
                self.console.log(f"step {step}: {shown}")
            self.progress.update(self.task, completed=step)

    def event(self, step: int, tag: str, message: str) -> None:
        """A guard or checkpoint event: a console line, a TensorBoard text entry and a line of MLflow's events file."""
        if not self.enabled:
            return
        if self.mlflow is not None:
            self.mlflow.event(step, tag, message)
        if self.writer is not None:
            self._to_tensorboard(lambda writer: writer.add_text(tag, message, step))
        if self.to_console:
            self.console.log(f"[yellow]{tag}[/yellow] step {step}: {message}")

    def _to_tensorboard(self, write: Callable[[SummaryWriter], Any]) -> None:
        """`write` to the event file, flushed. A write the filesystem refuses (TensorBoard's writer thread raises it
        at the next write or flush, and again at every later one) ends the run with a `LogWriteError` naming
        `trainer.log_dir`; the writer is then dropped, so that closing the logger does not raise it once more."""
        try:
            write(self.writer)
            self.writer.flush()
        except OSError as error:
            self.writer = None
            free = shutil.disk_usage(self.log_dir).free / 2**20 if self.log_dir.is_dir() else 0.0
            full = error.errno in (errno.ENOSPC, errno.EDQUOT)
            cause = "the disk is full" if full else error.strerror or type(error).__name__
            raise LogWriteError(
                f"the run's metrics could not be written to {self.log_dir} ({cause}; {free:.1f} MiB free): free space "
                "there, or point trainer.log_dir at a larger disk, and resume (`latest` names the last checkpoint; the "
                "steps since it are lost)"
            ) from None

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.close()


def _start_wandb(log_dir: Path, config: PPOConfig | None, run_id: str | None) -> Any:
    """The W&B run for `config` (see `MetricsLogger`)."""
    if config is None or run_id is None:
        raise ValueError("the wandb logger needs the run's config and run id (MetricsLogger(config=, run_id=))")
    try:
        import wandb
    except ImportError:
        raise RuntimeError(
            "trainer.logger includes wandb, but wandb is not installed; install the extra (pip install "
            "'megatron-ppo[wandb]') or drop wandb from trainer.logger"
        ) from None
    log_dir.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=config.trainer.project_name, name=config.trainer.experiment_name, id=run_id, resume="allow",
        dir=str(log_dir), config=dataclasses.asdict(config),
    )  # fmt: skip


def _start_mlflow(log_dir: Path, config: PPOConfig | None, run_id: str | None, total_steps: int) -> MlflowLogger | None:
    """The MLflow run for `config` (see `metrics_mlflow.py`); None when MLflow cannot be reached (it said so)."""
    if config is None or run_id is None:
        raise ValueError("the mlflow logger needs the run's config and run id (MetricsLogger(config=, run_id=))")
    log_dir.mkdir(parents=True, exist_ok=True)
    return MlflowLogger.start(log_dir, config, run_id, total_steps)
