"""A GPU check part whose trainer backs off from an out-of-memory error says so and fails: (b) at the dry run's tiny
shape with the actor update's first forward-backward raising `torch.OutOfMemoryError` once (as the fault drill
injects it) reports the back-off, the micro-batch it lowered and `ok: False`, and its table line says the figures
are a smaller shape's (before, the check's configs logged nowhere and the part reported tokens/s and MFU under the
shape it had asked for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.distributed.harness import run_distributed


def backed_off_iteration(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import torch

    from gpu_check import ppo_iteration
    from gpu_check.plan import DRY
    from megatron_ppo.config.schema import MegatronConfig
    from megatron_ppo.parallel import init_distributed
    from megatron_ppo.train import update

    init_distributed(MegatronConfig(), seed=0, device="cpu")
    original, raised = update.run_micro_batches, []

    def out_of_memory_once(model, *args, forward_only: bool, **kwargs):
        if model.role == "actor" and not forward_only and not raised:
            raised.append(True)
            raise torch.OutOfMemoryError("injected out-of-memory error")
        return original(model, *args, forward_only=forward_only, **kwargs)

    update.run_micro_batches = out_of_memory_once
    result = ppo_iteration.check_ppo_iteration(DRY, Path(root), seq=DRY.seq_lengths[0])
    return {"result": result, "lines": ppo_iteration.table_lines(result, shape="tiny"), "raised": len(raised)}


def test_a_backed_off_iteration_is_reported_and_fails(tmp_path) -> None:
    report = run_distributed(backed_off_iteration, 1, str(tmp_path))[0]
    result = report["result"]
    assert report["raised"] == 1
    assert result["oom_backoff"] == {"retries": 1, "lowered": {"actor.ppo_micro_batch_size_per_gpu": 3}}, result
    assert result["measured_after_backoff"] is True and result["ok"] is False
    assert any("FAILED: out of memory, backed off 1 time(s)" in line for line in report["lines"]), report["lines"]
