"""Which checkpoint a path, or a run's resume, names — by its files alone, without torch or Megatron, so that
`megatron-ppo validate` and the checks before any work stay cheap; `checkpoint/shapes.py` reads what it holds."""

from __future__ import annotations

from pathlib import Path

from megatron_ppo.config.schema import TrainerConfig

METADATA = ".metadata"  # PyTorch distributed checkpointing's: every tensor's global shape


def step_directory(path: str | Path) -> Path | None:
    """The checkpoint `path` names without Megatron (for `validate`): itself when it holds the metadata, else the
    step its `latest` names; None when neither (the run's start resolves it fully and says why)."""
    path = Path(path)
    if (path / METADATA).is_file():
        return path
    latest = path / "latest"
    if latest.is_file() and (path / latest.read_text().strip() / METADATA).is_file():
        return path / latest.read_text().strip()
    return None


def resumed_checkpoint(trainer: TrainerConfig) -> Path | None:
    """The checkpoint a resume would load, as `latest` (or `trainer.resume_from_path`) names it — read without
    Megatron, before any work; the run's start decides for good (`run_start.py`: it proves the bytes, and may fall back
    to an older checkpoint of the same run, of the same model). None: a new run, or nothing named to read."""
    if trainer.resume_mode == "disable":
        return None
    path = trainer.resume_from_path if trainer.resume_mode == "resume_path" else trainer.default_local_dir
    return step_directory(path) if path else None
