"""Metrics: TensorBoard event files and the console, written by global rank 0 only."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from torch.utils.tensorboard import SummaryWriter

CONSOLE_KEYS = (
    "reward/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "kl/mean",
    "kl/coef",
    "critic/vf_loss",
    "actor/grad_norm",
)


def is_logging_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


class MetricsLogger:
    """Scalars to `log_dir` (TensorBoard) and a one-line summary plus a progress bar with ETA on the console.

    The trainer passes its run's own folder, `<trainer.log_dir>/<run id>` (`train/run_start.py`), so event files of
    two runs never mix; a resumed run appends to its folder, and a step written again wins in `report`."""

    def __init__(self, log_dir: str | Path, loggers: list[str], total_steps: int, description: str = "ppo") -> None:
        self.enabled = is_logging_rank()
        self.console = Console(stderr=True)
        self.writer = SummaryWriter(str(log_dir)) if self.enabled and "tensorboard" in loggers else None
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
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if self.to_console:
            shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in CONSOLE_KEYS if k in metrics)
            self.console.log(f"step {step}: {shown}")
            self.progress.update(self.task, completed=step)

    def event(self, step: int, tag: str, message: str) -> None:
        """A guard or checkpoint event: a console line and a TensorBoard text entry."""
        if not self.enabled:
            return
        if self.writer is not None:
            self.writer.add_text(tag, message, step)
            self.writer.flush()
        if self.to_console:
            self.console.log(f"[yellow]{tag}[/yellow] step {step}: {message}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        if self.writer is not None:
            self.writer.close()
