"""The recipe smoke tests' shrink (`tests/support/recipe_shrink.py`): every shipped GPU recipe, shrunk, validates on
CPU, keeps each layout and feature flag it sets (a GPU-only one replaced by its CPU stand-in), and fits 2 or 4
processes with every parallel size at most 2."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_ppo.config.compose import load_config
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.gpu_only import GPU_ONLY
from megatron_ppo.config.schema import ROLES
from tests.support.recipe_shrink import HIDDEN, MAX_WORLD, PARALLEL_SIZES, shrink
from tests.unit.test_cpu_coverage import recipe_flags

REPO = Path(__file__).resolve().parents[2]
GPU_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if not p.stem.startswith("tiny"))
PATHS = ["model.tokenizer=/data/tokenizer.json", "data.train_files=[/data/rows.jsonl]"]


def _shrunk(recipe: Path, extra: list[str]):
    original = load_config(recipe, extra)
    shrunk = shrink(recipe, original)
    return original, shrunk, load_config(recipe, [*extra, *shrunk.overrides, *PATHS])


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=lambda p: p.name)
def test_a_shrunk_recipe_keeps_its_flags_and_fits_four_cpu_processes(recipe: Path) -> None:
    original, shrunk, small = _shrunk(recipe, [])
    stand_ins = {entry.setting for entry in GPU_ONLY if entry.present(original)}
    assert set(shrunk.swapped) == stand_ins and not any(entry.present(small) for entry in GPU_ONLY)
    kept = {flag for flag in recipe_flags(original) if not any(s.startswith(flag) for s in stand_ins)}
    assert kept <= recipe_flags(small), f"lost {kept - recipe_flags(small)}"
    added = recipe_flags(small) - recipe_flags(original)
    assert all(any(flag in o for e in GPU_ONLY for o in e.cpu_stand_in) for flag in added), added
    assert small.cluster.device == "cpu" and small.cluster.gpus_per_node == shrunk.world <= MAX_WORLD
    for role in ROLES:
        before, after = getattr(original, role).megatron, getattr(small, role).megatron
        for name in PARALLEL_SIZES:
            old, new = getattr(before, name), getattr(after, name)
            assert (new or 1) <= 2 and ((old or 1) > 1) == ((new or 1) > 1), f"{role}.megatron.{name}: {old} → {new}"
        same = {f.name for f in dataclasses.fields(before) if f.name not in (*PARALLEL_SIZES, "recompute_num_layers")}
        assert all(getattr(before, n) == getattr(after, n) for n in same), role
    assert small.model.hidden_size == HIDDEN and small.model.num_layers <= 4 and small.model.num_experts <= 4
    assert small.model.qk_layernorm == original.model.qk_layernorm
    assert small.model.add_qkv_bias == original.model.add_qkv_bias
    assert small.model.rope_scaling_factor == original.model.rope_scaling_factor
    assert small.actor.use_dynamic_bsz == original.actor.use_dynamic_bsz


def test_a_recipe_with_gpu_only_settings_runs_their_cpu_stand_ins() -> None:
    recipe = REPO / "recipes" / "qwen3-8b.yaml"
    extra = ["model.transformer_impl=transformer_engine", *(f"{r}.megatron.context_parallel_size=2" for r in ROLES)]
    # as a GPU node would load it with `extra` (no TE here to validate that)
    original = with_changes(
        load_config(recipe, []),
        {"model.transformer_impl": "transformer_engine", **{f"{r}.megatron.context_parallel_size": 2 for r in ROLES}},
    )
    shrunk = shrink(recipe, original)
    assert set(shrunk.swapped) == {e.setting for e in GPU_ONLY if e.present(original)} and len(shrunk.swapped) == 2
    small = load_config(recipe, [*extra, *shrunk.overrides, *PATHS])
    assert small.model.transformer_impl == "auto" and small.actor.megatron.context_parallel_size == 1


def test_recipes_with_the_same_shrunk_layout_share_a_run_and_others_do_not() -> None:
    layouts = {recipe.stem: shrink(recipe, load_config(recipe, [])).layout for recipe in GPU_RECIPES}
    assert layouts["qwen2.5-32b"] == layouts["qwen3-32b"] and layouts["llama3.1-70b"] == layouts["qwen2.5-72b"]
    assert layouts["qwen2.5-32b"] != layouts["qwen2.5-72b"], "virtual stages are part of the layout"
    assert layouts["qwen2.5-32b"] != layouts["qwen2.5-32b-1node"], "so is host offload"
    assert layouts["qwen2.5-32b"] != layouts["qwen2.5-32b-lora"], "LoRA is a run of its own, not the full fine-tune's"
