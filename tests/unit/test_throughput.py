"""Measured MFU from the planner's FLOP count, against the closed form 3·(2·N·T + 2·L·(heads·head_dim)·Σs²) per
training epoch: causal attention as Megatron-LM counts it (half the query–key pairs)."""

from __future__ import annotations

import pytest

from megatron_ppo.config.schema import ClusterConfig, ModelConfig, PPOConfig
from megatron_ppo.train.throughput import throughput_metrics, timing_metrics

L, H, FFN, V = 2, 64, 256, 1000


def _config() -> PPOConfig:
    config = PPOConfig(
        model=ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=4, ffn_hidden_size=FFN, vocab_size=V),
        cluster=ClusterConfig(nodes=1, gpus_per_node=2, gpu_type="h100-80gb"),
    )
    config.actor.ppo_epochs, config.critic.ppo_epochs = 2, 1
    return config


def test_update_mfu_is_training_flops_over_time_gpus_and_peak() -> None:
    lengths = [10, 20, 30]
    tokens, squares = sum(lengths), sum(s * s for s in lengths)
    layer = 4 * H * H + 3 * H * FFN + 2 * H  # q, k, v, o; SwiGLU; two norms
    actor_n = L * layer + H + V * H  # + final norm and the output layer (the input embedding is a lookup)
    critic_n = L * layer + H + H + 1  # the value head instead of the output layer
    train = lambda n: 3 * (2 * n * tokens + 2 * L * H * squares)  # noqa: E731  (heads·head_dim = H here)
    timings = {"experience": 1.0, "update_actor": 2.0, "update_critic": 0.5, "iteration": 4.0}
    metrics = throughput_metrics(_config(), ("actor", "ref", "critic"), lengths, timings)
    peak = 2 * 989e12  # two H100s
    assert metrics["perf/mfu/actor"] == pytest.approx(2 * train(actor_n) / (2.0 * peak))
    assert metrics["perf/mfu/critic"] == pytest.approx(train(critic_n) / (0.5 * peak))
    forward = sum(2 * n * tokens + 2 * L * H * squares for n in (actor_n, actor_n, critic_n))
    assert metrics["perf/mfu/experience"] == pytest.approx(forward / (1.0 * peak))
    total = 2 * train(actor_n) + train(critic_n) + forward
    assert metrics["perf/tflops_per_gpu"] == pytest.approx(total / (4.0 * 2) / 1e12)


def test_phases_that_did_not_run_report_nothing() -> None:
    timings = {"experience": 1.0, "update_critic": 0.5, "iteration": 2.0}  # critic warm-up: no actor update
    metrics = throughput_metrics(_config(), ("actor", "critic"), [8, 8], timings)
    assert "perf/mfu/actor" not in metrics and {"perf/mfu/critic", "perf/mfu/experience"} <= set(metrics)
    assert timing_metrics(timings) == {"timing/experience_s": 1.0, "timing/update_critic_s": 0.5}


def test_attention_counts_the_causal_half_of_the_query_heads_width() -> None:
    """Qwen3-style heads wider than the hidden size (16 heads × 128 = 2048 > 1024): the core attention's FLOPs
    follow heads·head_dim, over s²/2 query–key pairs per row of s tokens."""
    from megatron_ppo.planner.flops import pass_flops

    model = ModelConfig(num_layers=2, hidden_size=1024, num_attention_heads=16, kv_channels=128)
    attention = pass_flops(model, 0, 0.0, 4096.0**2, train=False)
    assert attention == 4 * 2 * 2048 * 4096**2 / 2  # q·kᵀ and p·v, 2 FLOPs per multiply-add, causal half
