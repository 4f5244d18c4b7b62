"""The trainer's update path: the gradient of a mini-batch does not depend on how it is cut into micro-batches
(every loss_agg_mode, actor and critic, through the real loss functions and Megatron's schedule), and a skipped
SFT step holds the learning-rate schedule; GRPO through the trainer keeps its groups whole and logs the off-policy
diagnostics of rows with behaviour log-probs; the metrics leave the device once per mini-batch, however many
micro-batches it has."""

from __future__ import annotations

import math

import pytest

from tests.distributed import update_workers
from tests.distributed.harness import run_distributed

# Also run against the oldest megatron-core admitted (`make test-floor`).
pytestmark = pytest.mark.floor


def test_gradient_does_not_depend_on_the_micro_batch_cut_in_any_mode() -> None:
    report = run_distributed(update_workers.gradients_by_cut, 1)[0]
    print("\nlargest relative gradient difference against one micro-batch, by micro-batch size:")
    for name, differences in report.items():
        print(f"  {name:32s} " + "  ".join(f"{size}: {d:.1e}" for size, d in differences.items()))
    assert len(report) == 11  # 5 modes × actor, critic; GSPO with sequence-level importance weights
    failing = {name: d for name, d in report.items() if max(d.values()) > 1e-5}
    assert not failing, f"gradients differ with the micro-batch cut: {failing}"


def test_a_skipped_sft_step_holds_the_learning_rate_schedule() -> None:
    report = run_distributed(update_workers.sft_skip_holds_the_schedule, 1)[0]
    assert report["num_steps"] == 0, f"the schedule advanced {report['num_steps']} steps over skipped updates"
    assert report["lr"] == 0.0, "warm-up starts at 0 and must stay there while steps are skipped"


def test_grpo_through_the_trainer_keeps_groups_whole_with_zero_mean_advantages(tmp_path) -> None:
    report = run_distributed(update_workers.grpo_through_the_trainer, 2, str(tmp_path))[0]  # TP 2, as the tiny recipe
    assert report["ref_equals_actor"], "with allow_random_init the reference must start as a copy of the actor"
    assert not report["critic"], "GRPO needs no critic"
    assert report["group_counts"] == [4] * 8, f"a batch of 32 rows must hold 8 whole groups of 4: {report}"
    assert report["largest_group_mean_advantage"] < 1e-5
    assert report["has_is_weights"], "rollout_correction.rollout_is=sequence must weigh the actor's loss"
    for metrics in report["history"]:
        assert metrics["grpo/singleton_groups"] == 0.0
        assert 0 < metrics["rollout_corr/rollout_is_eff_sample_size"] <= 1, metrics  # logged every iteration
        assert "rollout_corr/kl" in metrics and "rollout_corr/chi2_seq" in metrics
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        assert not bad, f"non-finite metrics: {bad}"


def test_metrics_reach_the_host_once_per_mini_batch_whatever_the_micro_batch_cut() -> None:
    report = run_distributed(update_workers.host_conversions_by_cut, 1)[0]
    print(f"\ntensor → Python conversions in the schedule and the metric reduction, by micro-batches: {report}")
    for role, by_cut in report.items():
        for micro_batches, counts in by_cut.items():
            total = sum(counts.values())
            assert total <= 1, (
                f"{role}, {micro_batches} micro-batch(es) in one mini-batch: {total} host conversions {counts}; a "
                "loss function must return tensors (MetricPart), reduce_parts moves them to the host in one transfer"
            )


@pytest.mark.parametrize("position_embedding_type", ["learned_absolute", "rope"])
def test_sft_under_the_cuda_width_bucket_equals_sft_without_it(position_embedding_type: str) -> None:
    """The CUDA width bucket (128) forced on CPU: the tiny recipe's shape at TP 2 trains as without it — padding
    columns get positions the 16-row learned table holds, and RoPE's angles for the real positions stay theirs."""
    for report in run_distributed(update_workers.sft_under_the_cuda_width_bucket, 2, position_embedding_type):
        assert report["same_start"] and report["moved"] > 1e-3, report
        assert report["bucket_ratio"] > 8 * report["ratio"], f"the bucket was not in force: {report}"
        assert report["diff"] < 1e-4, f"the weights moved apart by more than 1e-4 of their step: {report}"
        assert report["bucket_nll"] == pytest.approx(report["nll"], rel=1e-5), report
