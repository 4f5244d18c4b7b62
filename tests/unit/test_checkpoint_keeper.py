"""The keeper's record of its good and best checkpoints, read back from a trainer state: in the run's directory as it
is now, whatever directory the state was saved in (a run moved or copied must not roll back into the old place)."""

from __future__ import annotations

from pathlib import Path

from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.config.schema import TrainerConfig
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper


def test_the_good_and_best_checkpoints_are_read_in_the_runs_directory_as_it_is_now(tmp_path: Path) -> None:
    keeper = CheckpointKeeper(TrainerConfig(default_local_dir=str(tmp_path / "moved")), RunIdentity("run", "", {}))
    keeper.load_state_dict(
        {"best_checkpoint": "/scratch/old/ckpt/step_2", "good_checkpoint": "/scratch/old/ckpt/step_4"}
    )
    assert (keeper.best, keeper.good) == (str(tmp_path / "moved" / "step_2"), str(tmp_path / "moved" / "step_4"))
    keeper.load_state_dict({"best_checkpoint": None})  # a checkpoint from before the good one was kept
    assert (keeper.best, keeper.good) == (None, None)
    assert keeper.state_dict() == {"best_checkpoint": None, "good_checkpoint": None}
