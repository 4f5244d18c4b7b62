"""compare-kl: each invocation's variants write under a directory of their own."""

from __future__ import annotations

from pathlib import Path

from megatron_ppo.config import load_config
from megatron_ppo.tasks.addition.compare_kl import variants

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def test_each_invocation_and_variant_has_its_own_directories() -> None:
    config = load_config(TINY, ["trainer.default_local_dir=/out/tiny/checkpoints"])
    first, second = variants(config, "20261201-000000-aaaaaa"), variants(config, "20261201-000001-bbbbbb")
    directories = [(v.trainer.default_local_dir, v.trainer.log_dir) for v in [*first.values(), *second.values()]]
    assert len({d for pair in directories for d in pair}) == 16, directories
    staged = first["staged"].trainer
    assert staged.default_local_dir == "/out/tiny/compare-kl/20261201-000000-aaaaaa/staged/checkpoints"
    assert staged.log_dir == "/out/tiny/compare-kl/20261201-000000-aaaaaa/staged/tensorboard"
    assert all(v.trainer.resume_mode == "disable" for v in first.values())
