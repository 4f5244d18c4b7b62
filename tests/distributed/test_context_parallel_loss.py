"""Context parallelism's bookkeeping on CPU, where its attention cannot run: our split is Megatron's, and for the
same rows split over CP = 2 ranks, the trainer's losses pushed through Megatron's own loss scaling (× CP) and DDP's
(÷ DP·CP, summed) give CP = 1's gradient and metrics — except seq-mean-token-mean, which validation refuses."""

from __future__ import annotations

from tests.distributed import context_parallel_workers
from tests.distributed.harness import run_distributed


def test_the_split_is_megatrons_load_balanced_split() -> None:
    for rank, problems in enumerate(run_distributed(context_parallel_workers.split_agrees_with_megatron, 4)):
        assert problems == [], f"rank {rank}: {problems}"


def test_split_rows_give_cp1_gradients_and_metrics_in_every_summable_mode() -> None:
    report = run_distributed(context_parallel_workers.loss_scale_against_cp1, 1)[0]
    assert report.pop("merged log-probs") == 0.0, "per-rank log-probs merged back must be the whole rows' log-probs"
    for name, result in report.items():
        if name.endswith("seq-mean-token-mean"):
            # each rank divides by its own share of a row's tokens: refused with CP by validation, and wrong here
            assert result["grad"] > 0.1, f"{name}: expected to differ from CP 1 (validation refuses it)"
            continue
        assert result["grad"] < 1e-6, f"{name}: gradient differs from CP 1 by {result['grad']:.2e} (relative)"
        bad = {key: diff for key, diff in result["metrics"].items() if diff > 1e-5}
        assert not bad, f"{name}: metrics differ from CP 1: {bad}"
