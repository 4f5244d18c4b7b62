"""The tiny recipe's task (`data.task=addition`): two-digit addition, end to end on a CPU.

A character tokenizer, an SFT policy trained on a noisy demonstrator, an offline dataset sampled from it and
scored by rule, offline PPO from that policy, and greedy evaluation on held-out prompts; `compare-kl` runs the
PPO stage under four KL controls.
"""

from __future__ import annotations

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import PPOConfig


def run(config: PPOConfig) -> dict[str, float]:
    """The whole recipe; returns the summary numbers it prints."""
    from megatron_ppo.tasks.addition.recipe import run_addition_recipe
    from megatron_ppo.train.run import distributed_run

    with distributed_run(config) as weights:
        return run_addition_recipe(config, weights)


def score(config: PPOConfig) -> None:
    """`megatron-ppo score` on the tiny recipe: the task's reward model (trained from its labels once) scores its
    dataset (`reward_model.py`)."""
    from megatron_ppo.tasks.addition.reward_model import score as score_task

    score_task(config)


def compare_kl(config: PPOConfig, plot: str | None = None) -> dict[str, dict[str, float]]:
    """The PPO stage with the KL term off, fixed, adaptive and staged (same SFT start, data and seed); `plot`: their
    figure's file ("" for the default, see `compare_kl.compare_kl`)."""
    if config.data.task != "addition":
        raise ConfigError(["compare-kl runs the tiny recipe's task: set data.task=addition"])
    from megatron_ppo.tasks.addition.compare_kl import compare_kl as run_comparison
    from megatron_ppo.train.run import distributed_run

    with distributed_run(config) as weights:
        return run_comparison(config, plot, weights)
