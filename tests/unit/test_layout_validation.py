"""Validation of context parallelism and host offload: what cannot run is refused, with the reason and the fix."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.config.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "qwen2.5-32b.yaml"
CP2 = [f"{role}.megatron.context_parallel_size=2" for role in ("actor", "critic", "ref")]


def _problems(recipe: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        load_config(recipe, overrides)
    return refused.value.problems


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine is here")
def test_context_parallel_without_transformer_engine_is_refused_with_the_reason() -> None:
    problems = _problems(RECIPE, CP2)
    assert any("exchanges keys and values between the CP ranks" in p and "not installed" in p for p in problems), (
        problems
    )


def test_context_parallel_on_cpu_and_with_per_row_means_is_refused() -> None:
    cpu = _problems(REPO / "recipes" / "tiny-cpu.yaml", [*CP2, "cluster.gpus_per_node=4"])
    assert any("needs Transformer Engine attention (GPU); use 1 on CPU" in p for p in cpu), cpu
    per_row = _problems(RECIPE, [*CP2, "critic.loss_agg_mode=seq-mean-token-mean"])
    assert any("critic.loss_agg_mode='seq-mean-token-mean'" in p for p in per_row), per_row
    assert not any("actor.loss_agg_mode" in p for p in per_row)
    gspo = _problems(RECIPE, [*CP2, "actor.policy_loss.loss_mode=gspo"])
    assert any("loss_mode='gspo' takes one ratio per whole row" in p for p in gspo), gspo


def test_packing_with_context_parallelism_is_refused_naming_the_key() -> None:
    problems = _problems(RECIPE, [*CP2, "model.pack_sequences=true"])
    assert any(p.startswith("model.pack_sequences=true with actor.megatron.context_parallel_size=2 is not built")
               for p in problems), problems  # fmt: skip
    verl = _problems(RECIPE, [*CP2, "actor_rollout_ref.model.use_remove_padding=true"])
    assert any(p.startswith("model.pack_sequences=true with") for p in verl), verl


def test_the_reference_offloads_only_its_weights() -> None:
    problems = _problems(RECIPE, ["ref.megatron.grad_offload=true", "ref.megatron.param_offload=true"])
    assert problems == [
        "ref.megatron.grad_offload=true: the reference has no gradients; use ref.megatron.param_offload for its weights"
    ]


def test_lora_with_context_parallelism_is_refused_with_its_fix() -> None:
    """LoRA builds the local spec (its adapters sit on Megatron's linear layers), whose attention cannot exchange
    keys and values around the CP ring: refused by `validate` with the fix, where it used to pass and raise when the
    attention was built."""
    lora = _problems(REPO / "recipes" / "qwen2.5-32b-lora.yaml", CP2)
    for role in ("actor", "critic"):
        fix = f"({role}.lora.rank=0)"
        assert any(f"with {role}.lora.rank=64" in p and fix in p and "CP 1" in p for p in lora), lora
    actor_only = _problems(REPO / "recipes" / "qwen2.5-32b-lora.yaml", [*CP2, "critic.lora.rank=0"])
    assert not any("critic.lora" in p for p in actor_only), actor_only
