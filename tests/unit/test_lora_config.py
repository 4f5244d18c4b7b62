"""LoRA's keys (`actor.lora.*`, `critic.lora.*`): what adapters cannot serve is refused before any model is built,
naming the key and the fix; verl's LoRA paths land on ours; the planner counts a LoRA run's memory (the adapters'
gradients and Adam states, no reference weights), so the 72B recipe's LoRA variant fits one node where the full
fine-tune does not."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.planner.plan import plan

REPO = Path(__file__).resolve().parents[2]
TINY, TINY_MOE = REPO / "recipes" / "tiny-cpu.yaml", REPO / "recipes" / "tiny-moe-cpu.yaml"


def _problems(recipe: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        load_config(recipe, overrides)
    return refused.value.problems


@pytest.mark.parametrize(
    ("recipe", "overrides", "expected"),
    [
        (TINY_MOE, ["actor.lora.rank=8"], "actor.lora.rank=8: adapters on the experts' layers are not built"),
        (TINY, ["critic.lora.rank=8", "model.transformer_impl=transformer_engine"], "critic.lora.rank=8: adapters sit"),
        (TINY, ["actor.lora.rank=8", "ref.megatron.tensor_model_parallel_size=1"], "set ref.megatron like actor"),
        (TINY, ["actor.lora.rank=8", "ref.megatron.param_offload=true"], "ref.megatron.param_offload=true: with"),
        (TINY, ["actor.lora.merge=true"], "actor.lora.merge=true merges adapters, but actor.lora.rank=0"),
        (TINY, ["critic.lora.rank=4", "critic.lora.merge=true"], "critic.lora.merge=true: `convert mcore-to-hf`"),
        (TINY, ["actor.lora.rank=4", "actor.lora.target_modules=[]"], "actor.lora.target_modules is empty"),
        (TINY, ["actor.lora.target_modules=[lm_head]"], "actor.lora.target_modules"),
        (TINY, ["actor.lora.rank=-1"], "actor.lora.rank"),
    ],
)
def test_what_lora_cannot_serve_is_refused_with_the_fix(recipe: Path, overrides: list[str], expected: str) -> None:
    problems = _problems(recipe, overrides)
    assert any(expected in problem for problem in problems), problems


def test_verl_lora_paths_land_on_ours() -> None:
    config = load_config(TINY, ["actor_rollout_ref.model.lora.rank=8", "critic.model.lora.alpha=32"])
    assert config.actor.lora.rank == 8 and config.critic.lora.alpha == 32


def test_the_base_reference_may_differ_from_the_actor_only_where_a_forward_does_not_look() -> None:
    config = load_config(REPO / "recipes" / "qwen2.5-72b-lora.yaml", [])
    assert config.ref.megatron.use_distributed_optimizer != config.actor.megatron.use_distributed_optimizer


def test_lora_plans_the_72b_recipe_on_one_node_where_the_full_fine_tune_does_not_fit() -> None:
    lora = plan(load_config(REPO / "recipes" / "qwen2.5-72b-lora.yaml", []))
    full = plan(load_config(REPO / "recipes" / "qwen2.5-72b.yaml", []))
    assert lora.world_size == 8 and lora.fits and full.world_size == 64, (lora.peak_gib, full.peak_gib)
    assert lora.roles["ref"].weights_gib == 0, "a LoRA actor's reference is its base: no weights of its own"
    for role in ("actor", "critic"):  # Adam's states of the adapters alone against those of every weight
        assert lora.roles[role].optimizer_gib < lora.roles[role].weights_gib / 5, lora.roles[role]
        assert full.roles[role].optimizer_gib > full.roles[role].weights_gib, full.roles[role]
    one_node = [f"{role}.megatron.{key}" for role in ("actor", "ref", "critic")
                for key in ("pipeline_model_parallel_size=1", "virtual_pipeline_model_parallel_size=null")]  # fmt: skip
    assert not plan(load_config(REPO / "recipes" / "qwen2.5-72b.yaml", ["cluster.nodes=1", *one_node])).fits


def test_the_adapter_names_its_base_by_an_absolute_path_or_as_a_hub_name(tmp_path, monkeypatch) -> None:
    """`convert mcore-to-hf --hf-config hf/qwen` (relative) wrote `hf/qwen` into `adapter_config.json`, a folder
    relative to wherever peft later loads the adapter from; now the absolute folder. A name with no such folder here
    (a Hub model) stays as written."""
    from megatron_ppo.convert.peft_adapter import base_model_path

    (tmp_path / "hf" / "qwen").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert base_model_path("hf/qwen") == str(tmp_path / "hf" / "qwen")
    assert base_model_path("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"
