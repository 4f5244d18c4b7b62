"""Spawned-rank code for `megatron-ppo score`: the scoring job of a recipe, and the same rows scored by `transformers`'
own sequence classifier."""

from __future__ import annotations

import torch
import transformers

from megatron_ppo.config import load_config
from megatron_ppo.convert.reward_scoring import score


def score_recipe(rank: int, world_size: int, recipe: str, overrides: list[str]) -> list[float] | None:
    """The job `megatron-ppo score RECIPE OVERRIDES` runs; the rewards it wrote, on the rank that wrote them."""
    results = score(load_config(recipe, overrides))
    return [float(r) for result in results for r in result.rewards] if rank == world_size - 1 else None


def hf_rewards(hf_dir: str, sequences: list[list[int]]) -> list[float]:
    """`AutoModelForSequenceClassification`'s score of each sequence (prompt + response ids), one at a time: the
    logit transformers pools at the last non-pad token."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return [float(model(torch.tensor([ids])).logits[0, 0]) for ids in sequences]
