"""Mixture-of-experts keys: what validation refuses (each message names the fix), how they map onto Megatron's
TransformerConfig, and the padding that gives the allgather dispatcher equal token counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models import build_transformer_config
from megatron_ppo.models.context_parallel import chunk_positions
from megatron_ppo.models.moe import pad_tokens, routing_padding_mask
from megatron_ppo.models.router_replay import replay_bypasses

TINY_MOE = Path(__file__).resolve().parents[2] / "recipes" / "tiny-moe-cpu.yaml"
ALL_ROLES = ("actor", "ref", "critic")


def _layout(**keys: int) -> list[str]:
    return [f"{role}.megatron.{key}={value}" for role in ALL_ROLES for key, value in keys.items()]


def _problems(*overrides: str, recipe: Path = TINY_MOE) -> str:
    with pytest.raises(ConfigError) as error:
        load_config(recipe, overrides)
    return str(error.value)


INVALID = [
    ([*_layout(expert_model_parallel_size=2), "model.num_experts=3"], ["num_experts=3 must split evenly", "[1, 3]"]),
    (
        [*_layout(expert_model_parallel_size=4), "model.num_experts=8", "cluster.gpus_per_node=2"],
        ["EP × expert-TP × PP = 4×1×1 = 4 does not divide the world size 2", "use EP among [1, 2]"],
    ),
    (["model.moe_token_dispatcher=alltoall"], ["needs CUDA", "use 'allgather' on CPU"]),
    (
        [*_layout(expert_tensor_parallel_size=2), "model.add_bias_linear=true"],
        ["expert_tensor_parallel_size=2", "only at expert TP 1"],
    ),
    ([*_layout(expert_tensor_parallel_size=3), "cluster.gpus_per_node=6"], ["moe_intermediate_size=256", "among"]),
    (
        _layout(tensor_model_parallel_size=2, expert_model_parallel_size=1),
        ["tensor_model_parallel_size=2", "only with sequence parallelism", "set actor.megatron.sequence_parallel=true"],
    ),
    (["model.num_experts_per_tok=5"], ["num_experts_per_tok=5", "1..num_experts=4"]),
    (["model.moe_intermediate_size=0"], ["moe_intermediate_size=0", "FFN width"]),
    (["actor.megatron.expert_model_parallel_size=1"], ["expert_model_parallel_size=1", "share one"]),
]


@pytest.mark.parametrize(("overrides", "expected"), INVALID, ids=lambda v: " ".join(v)[:60])
def test_invalid_moe_config_names_the_key_and_the_fix(overrides: list[str], expected: list[str]) -> None:
    message = _problems(*overrides)
    for fragment in expected:
        assert fragment in message, f"{fragment!r} missing from:\n{message}"


def test_expert_keys_on_a_dense_model_are_refused() -> None:
    message = _problems(
        "model.num_experts_per_tok=2", "model.router_aux_loss_coef=0.01", "actor.megatron.expert_model_parallel_size=2",
        "ref.megatron.expert_model_parallel_size=2", "critic.megatron.expert_model_parallel_size=2",
        recipe=TINY_MOE.with_name("tiny-cpu.yaml"),
    )  # fmt: skip
    for fragment in ("model.num_experts_per_tok=2", "model.router_aux_loss_coef=0.01", "need experts"):
        assert fragment in message, f"{fragment!r} missing from:\n{message}"


def test_tiny_moe_recipe_spreads_experts_over_the_data_parallel_ranks() -> None:
    config = load_config(TINY_MOE)
    assert (config.model.num_experts, config.model.num_experts_per_tok) == (4, 2)
    for role in ALL_ROLES:
        layout = getattr(config, role).megatron
        assert (layout.tensor_model_parallel_size, layout.expert_model_parallel_size) == (1, 2)


MOE = ModelConfig(params_dtype="fp32", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                  router_aux_loss_coef=0.01)  # fmt: skip


@pytest.mark.parametrize(("norm_topk_prob", "pre_softmax"), [(True, False), (False, True)])
def test_hf_top_k_normalisation_maps_onto_megatrons_softmax_placement(norm_topk_prob: bool, pre_softmax: bool) -> None:
    # renormalised top-k of softmax(all) = softmax over the top-k logits (Megatron's default); without it the
    # softmax runs over all experts before the top-k
    model = ModelConfig(**{**MOE.__dict__, "norm_topk_prob": norm_topk_prob})
    config = build_transformer_config(model, MegatronConfig(expert_model_parallel_size=2), with_aux_loss=True)
    assert config.moe_router_pre_softmax is pre_softmax
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (8, 2, 64)
    assert config.moe_expert_capacity_factor is None, "dropless, as Hugging Face routes"
    assert (config.expert_model_parallel_size, config.expert_tensor_parallel_size) == (2, 1)
    assert config.moe_token_dispatcher_type == "allgather" and not config.moe_grouped_gemm  # CPU: SequentialMLP


def test_only_the_actor_carries_the_load_balancing_loss() -> None:
    actor = build_transformer_config(MOE, MegatronConfig(), with_aux_loss=True)
    critic = build_transformer_config(MOE, MegatronConfig(), with_aux_loss=False)
    assert (actor.moe_router_load_balancing_type, actor.moe_aux_loss_coeff) == ("aux_loss", 0.01)
    assert (critic.moe_router_load_balancing_type, critic.moe_aux_loss_coeff) == ("none", 0.0)


def test_a_dense_model_has_no_moe_fields() -> None:
    config = build_transformer_config(ModelConfig(params_dtype="fp32"), MegatronConfig())
    assert config.num_moe_experts is None and config.moe_ffn_hidden_size is None


def test_padding_for_the_allgather_dispatcher_goes_below_and_right_and_is_masked_from_routing() -> None:
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    positions = torch.arange(3).expand(2, 3)
    mask = torch.ones(3, 3, dtype=torch.bool).triu(1).expand(2, 1, 3, 3)
    ids, pos, padded_mask = pad_tokens(input_ids, positions, mask, (3, 5))
    assert torch.equal(ids[:2, :3], input_ids) and int(ids[2:].abs().sum() + ids[:, 3:].abs().sum()) == 0
    assert torch.equal(pos[:2, :3], positions), "real positions travel along"
    assert int(pos[2:].abs().sum() + pos[:, 3:].abs().sum()) == 0, "padding at position 0, in every learned table"
    assert torch.equal(padded_mask, torch.ones(5, 5, dtype=torch.bool).triu(1).expand(3, 1, 5, 5)), "still causal"
    routing = routing_padding_mask(torch.tensor([3, 2]), (3, 5))
    expected = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(routing, expected), f"True where no real token: {routing}"


def test_a_context_parallel_ranks_routing_mask_follows_its_chunks() -> None:
    """At CP 2 a rank's 8 columns of a 16-token row are chunks (r, 3 − r): rank 0 holds positions 0–3 and 12–15,
    so a row of 10 tokens has its padding in rank 0's last 4 columns and rank 1's last 2, not at columns ≥ 10."""
    lengths = torch.tensor([10, 3])
    masks = [routing_padding_mask(lengths, (3, 8), chunk_positions(16, 2, rank)) for rank in (0, 1)]
    assert masks[0][0].tolist() == [False] * 4 + [True] * 4 and masks[1][0].tolist() == [False] * 6 + [True] * 2
    assert int(sum((~mask).sum() for mask in masks)) == 13, "every real token once, in one rank's statistics"
    assert all(mask[2].all() for mask in masks), "a padded row holds no real token"


def test_routing_replay_on_a_dense_model_is_refused() -> None:
    message = _problems("actor.router_replay.mode=R2", recipe=TINY_MOE.with_name("tiny-cpu.yaml"))
    assert "actor.router_replay.mode=R2" in message and "set actor.router_replay.mode=disabled" in message


def test_routing_replay_refuses_router_paths_that_bypass_its_hook() -> None:
    config = build_transformer_config(MOE, MegatronConfig(), with_aux_loss=True, routing_replay=True)
    assert config.moe_enable_routing_replay and replay_bypasses(config) == []
    config.moe_router_fusion = True  # the fused top-k returns before Megatron's replay hook
    config.moe_router_load_balancing_type = "sinkhorn"
    config.moe_expert_capacity_factor = 1.0
    problems = " | ".join(replay_bypasses(config))
    for fragment in ("moe_router_fusion", "sinkhorn", "moe_expert_capacity_factor"):
        assert fragment in problems, problems
    dense = build_transformer_config(ModelConfig(params_dtype="fp32"), MegatronConfig())
    assert "dense" in replay_bypasses(dense)[0]


def test_the_moe_recipes_turn_r2_on_and_the_tiny_one_can() -> None:
    recipes = TINY_MOE.parent
    for name in ("qwen3-30b-a3b.yaml", "qwen3-235b-a22b.yaml"):
        assert load_config(recipes / name).actor.router_replay.mode == "R2", name
        assert "router_replay" in (recipes / name).read_text().split("defaults:")[0], f"{name}: header says why"
    assert load_config(TINY_MOE, ["actor.router_replay.mode=R2"]).actor.router_replay.mode == "R2"


def test_routing_replay_with_packed_sequences_is_accepted() -> None:
    """Replay follows packs (`models.router_replay`): R2 / R3 with `model.pack_sequences=true` validate, and the MoE
    recipes pack with R2 on."""
    config = load_config(TINY_MOE, ["actor.router_replay.mode=R2", "model.pack_sequences=true"])
    assert config.actor.router_replay.mode == "R2" and config.model.pack_sequences
    for name in ("qwen3-30b-a3b.yaml", "qwen3-235b-a22b.yaml"):
        assert load_config(TINY_MOE.parent / name).model.pack_sequences, name
