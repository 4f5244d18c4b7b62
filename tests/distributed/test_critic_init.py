"""The critic initialised from its own checkpoint: a one-label `transformers` reward model (Qwen2, Llama) gives our
critic its trunk and its value head — the critic's value at every token equals the reward model's score there, at
TP 1 and PP 2 — while a causal LM, or a megatron-ppo checkpoint holding only an actor, gives the trunk and a zero
head."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ppo.config.schema import MegatronConfig
from tests.distributed import critic_init_workers as workers
from tests.distributed.harness import run_distributed
from tests.support.hf_models import save_hf_scorer

LAYOUTS = {"tp1": (1, MegatronConfig()), "pp2": (2, MegatronConfig(pipeline_model_parallel_size=2))}


@pytest.mark.parametrize(("kind", "layout"), [("qwen2", "tp1"), ("llama", "pp2")])
def test_a_reward_model_gives_the_critic_its_trunk_and_its_value_head(tmp_path: Path, kind: str, layout: str) -> None:
    hf_dir = str(save_hf_scorer(kind, tmp_path / "rm"))
    world, megatron_layout = LAYOUTS[layout]
    results = run_distributed(workers.critic_values, world, hf_dir, str(tmp_path), megatron_layout, "hf")
    ((described, ours),) = [(d, v) for d, v in results if v is not None]
    expected = workers.hf_token_values(hf_dir)
    assert described.startswith("critic from the critic of "), described
    assert expected.abs().max() > 0.1, "the test model's scores are too small to show a misplaced head"
    difference = float((ours - expected).abs().max())
    assert difference < 1e-4, (
        f"{kind} at {layout}: critic values differ from the reward model's scores by {difference:.2e}"
    )


def test_a_causal_lm_or_an_actor_checkpoint_gives_a_zero_value_head(tmp_path: Path) -> None:
    hf_dir = str(save_hf_scorer("qwen2", tmp_path / "lm", num_labels=0))
    ((described, values),) = run_distributed(workers.critic_values, 1, hf_dir, str(tmp_path), MegatronConfig(), "hf")
    assert described.startswith("critic from the critic of ") and torch.equal(values, torch.zeros_like(values))
    ((described, values),) = run_distributed(workers.critic_values, 1, hf_dir, str(tmp_path), MegatronConfig(), "actor")
    assert described.startswith("critic from the actor trunk of ") and described.endswith("a zero value head")
    assert torch.equal(values, torch.zeros_like(values))
