"""Every real recipe (7B–235B) carries the PPO parameters of our source write-ups (configs/writeups.yaml says which
write-up each follows and why), read from its resolved config as `megatron-ppo validate` resolves it; a recipe may
differ only where its header gives the value and the measured reason (`make plan`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_ppo.config import load_config
from megatron_ppo.config.validate import get, validate

REPO = Path(__file__).resolve().parents[2]
REAL_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if not p.stem.startswith("tiny"))
TINY_RECIPES = sorted((REPO / "recipes").glob("tiny*.yaml"))

# key → (value, where it comes from): A = KL thresholds + gradient clipping, B = offline PPO hyperparameters
WRITEUPS: dict[str, tuple[object, str]] = {
    "data.train_batch_size": (512, "A and B"),
    "actor.ppo_mini_batch_size": (128, "B's 64–256"),
    "critic.ppo_mini_batch_size": (128, "B's 64–256"),
    "actor.ppo_epochs": (4, "A and B"),
    "critic.ppo_epochs": (4, "A and B"),
    "actor.optim.lr": (1.0e-6, "B"),
    "critic.optim.lr": (1.0e-5, "B"),
    "actor.optim.clip_grad": (1.0, "A and B"),
    "critic.optim.clip_grad": (0.8, "A"),
    "actor.clip_ratio_low": (0.2, "A and B"),
    "actor.clip_ratio_high": (0.3, "A (B: 0.2)"),
    "actor.clip_ratio_c": (3.0, "A"),
    "actor.entropy_coeff": (0.0, "A (B: 0.01)"),
    "critic.cliprange_value": (0.2, "B"),
    "actor.use_kl_loss": (True, "A and B"),
    "actor.kl_loss_coef": (0.001, "A and B"),
    "actor.kl_loss_type": ("low_var_kl", "B"),
    "algorithm.use_kl_in_reward": (False, "neither: both regularise with the KL loss"),
    "algorithm.adv_estimator": ("gae", "A and B"),
    "algorithm.gamma": (1.0, "A and B"),
    "algorithm.lam": (0.95, "A and B"),
    "reward.clip_range": ([-2, 2], "B"),
    "actor.use_dynamic_bsz": (True, "B"),
    "critic.use_dynamic_bsz": (True, "B"),
    "actor.ppo_max_token_len_per_gpu": (16384, "B"),
    "critic.ppo_max_token_len_per_gpu": (16384, "B"),
    "actor.ppo_micro_batch_size_per_gpu": (2, "A, for the evaluation only: B's token budget cuts the rest"),
    "critic.ppo_micro_batch_size_per_gpu": (2, "A, for the evaluation only: B's token budget cuts the rest"),
    "trainer.save_freq": (10, "neither: B's every 5 epochs saves only at the end of a 1-epoch run"),
    "algorithm.kl_ctrl.type": ("staged", "A's staged thresholds"),
}
# (recipe, key) → the value its header gives, with `make plan`'s peak at the write-up's value
EXCEPTIONS: dict[tuple[str, str], object] = {
    **{("qwen3-8b", f"{role}.ppo_max_token_len_per_gpu"): 12288 for role in ("actor", "critic")},
}
STAGED_TARGETS = [None, 0.008, 0.012, 0.015]  # A's early / mid / late, after the warm-up


def _header(recipe: Path) -> str:
    return "".join(line for line in recipe.read_text().splitlines(keepends=True) if line.startswith("#"))


@pytest.mark.parametrize("recipe", REAL_RECIPES, ids=lambda p: p.stem)
def test_real_recipe_takes_the_writeups_values_or_states_why_not(recipe: Path) -> None:
    config = load_config(recipe)
    assert validate(config) == [], f"{recipe.name} does not validate"
    differing = []
    for key, (value, source) in WRITEUPS.items():
        expected = EXCEPTIONS.get((recipe.stem, key), value)
        if get(config, key) != expected:
            differing.append(f"{key}={get(config, key)!r}, the write-ups' ({source}): {value!r}")
    assert not differing, f"{recipe.name}: " + "; ".join(differing)
    assert [s.target_kl for s in config.algorithm.kl_ctrl.stages] == STAGED_TARGETS


@pytest.mark.parametrize("recipe, key", sorted(EXCEPTIONS), ids=lambda v: str(v))
def test_every_exception_is_in_its_recipe_header_with_the_plan(recipe: str, key: str) -> None:
    header = _header(REPO / "recipes" / f"{recipe}.yaml")
    assert str(EXCEPTIONS[recipe, key]) in header and "make plan" in header, (
        f"recipes/{recipe}.yaml sets {key}={EXCEPTIONS[recipe, key]} but its header does not give the value and "
        "the planner's reason"
    )


@pytest.mark.parametrize("recipe", REAL_RECIPES, ids=lambda p: p.stem)
def test_real_recipe_header_names_the_writeups_preset(recipe: Path) -> None:
    """A recipe lists the write-ups' preset and names it in its header — or is a variant of one that does (the LoRA
    recipes over their full fine-tune), listing that recipe first and naming it in its header."""
    defaults = yaml.safe_load(recipe.read_text())["defaults"]
    base = REPO / "recipes" / f"{defaults[0]}.yaml"
    if base in REAL_RECIPES:
        assert f"recipes/{base.name}" in _header(recipe), (
            f"{recipe.name} is a variant of {base.name} but its header does not say so"
        )
        recipe = base
    assert "configs/writeups.yaml" in _header(recipe)
    assert "writeups" in yaml.safe_load(recipe.read_text())["defaults"]


@pytest.mark.parametrize("recipe", TINY_RECIPES, ids=lambda p: p.stem)
def test_tiny_recipes_keep_their_task_scale_values(recipe: Path) -> None:
    config = load_config(recipe)
    assert "writeups" not in recipe.read_text()
    assert config.actor.optim.lr == 1.0e-4 and config.actor.kl_loss_coef == 0.15 and not config.actor.use_dynamic_bsz
