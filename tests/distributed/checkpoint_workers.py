"""Spawned-rank code for the checkpoint tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_ppo import checkpoint
from megatron_ppo.config.schema import MegatronConfig, OptimConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.parallel import init_distributed
from megatron_ppo.train.optimizer import build_optimizer
from tests.distributed.workers import MODEL, weights


def publish_and_recover(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save steps 1 and 2, then break things the way a killed save or a lost file would."""
    root = Path(root)
    init_distributed(MegatronConfig(), seed=0)
    actor = build_role_model("actor", MODEL, MegatronConfig())
    optimizer = build_optimizer(actor, OptimConfig(lr=1e-3), MegatronConfig())
    report: dict[str, Any] = {}
    for step in (1, 2):
        with torch.no_grad():
            for parameter in actor.chunks[0].parameters():
                parameter.add_(0.01 * step)
        checkpoint.save_checkpoint(root, step, {"actor": actor}, {"actor": optimizer}, {"step": step}, keep=5)
    saved_at_2 = weights(actor)
    report["after_two_saves"] = checkpoint.find_resumable(root).name
    (root / ".tmp_step_3").mkdir()
    (root / ".tmp_step_3" / "partial.distcp").write_bytes(b"half a shard")
    report["with_a_half_written_save"] = checkpoint.find_resumable(root).name
    with torch.no_grad():
        for parameter in actor.chunks[0].parameters():
            parameter.zero_()
    state = checkpoint.load_checkpoint(root / "step_2", {"actor": actor}, {"actor": optimizer})
    report["restored_step"] = state["step"]
    report["weights_restored"] = all(torch.equal(v, saved_at_2[k]) for k, v in weights(actor).items())
    (root / "step_2" / "metadata.json").unlink()
    report["with_step_2_broken"] = checkpoint.find_resumable(root).name
    checkpoint.save_checkpoint(root, 4, {"actor": actor}, {"actor": optimizer}, {"step": 4}, keep=1)
    report["kept_after_prune"] = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    return report
