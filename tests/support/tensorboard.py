"""A run's scalars read back with TensorBoard's own reader, as a user's TensorBoard would show them."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from megatron_ppo.runs.report import find_runs


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """tag → {step: value} of the run written last under `log_dir` (`trainer.log_dir`; each run writes its own
    folder there), the last value written for a step winning."""
    accumulator = EventAccumulator(str(find_runs(log_dir)[-1]), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {
        tag: {event.step: event.value for event in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]
    }
