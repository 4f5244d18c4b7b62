"""The planner: parameter counts against the published model sizes, every recipe plans, and a layout that cannot
fit is flagged with one that does; for a mixture of experts, total and active parameters against the published
config.json, the experts sharded by EP, the all-to-all in the step time, and a fitting layout with EP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ppo.cli import main
from megatron_ppo.config import load_config
from megatron_ppo.config.gpus import GPU_SPECS
from megatron_ppo.planner.flops import active_parameter_count, expert_parameter_count, parameter_count
from megatron_ppo.planner.plan import plan, suggest
from tests.support.hf_models import tiny_hf_config

REPO = Path(__file__).resolve().parents[2]
# Sizes on the models' Hugging Face cards (billions of parameters).
PUBLISHED = {"qwen2.5-7b": 7.61, "qwen2.5-32b": 32.5, "qwen2.5-72b": 72.7, "llama3.1-70b": 70.6, "qwen3-8b": 8.2,
             "qwen3-32b": 32.8, "qwen3-moe-30b-a3b": 30.5, "qwen3-moe-235b-a22b": 235.0}  # fmt: skip
# Active parameters per token on the MoE models' cards (the "A3B", "A22B": 3.3 B, 22 B).
PUBLISHED_ACTIVE = {"qwen3-moe-30b-a3b": 3.3, "qwen3-moe-235b-a22b": 22.0}
BIG_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml") if p.stem != "tiny-cpu")


@pytest.mark.parametrize("model", list(PUBLISHED))
def test_parameter_count_matches_the_published_size(model: str) -> None:
    count = parameter_count(load_config(REPO / "configs" / "models" / f"{model}.yaml").model) / 1e9
    assert abs(count / PUBLISHED[model] - 1) < 0.01, f"{model}: {count:.3f} B vs published {PUBLISHED[model]} B"


@pytest.mark.parametrize("model", list(PUBLISHED_ACTIVE))
def test_active_parameter_count_matches_the_published_size(model: str) -> None:
    count = active_parameter_count(load_config(REPO / "configs" / "models" / f"{model}.yaml").model) / 1e9
    assert abs(count / PUBLISHED_ACTIVE[model] - 1) < 0.02, (
        f"{model}: {count:.3f} B active vs {PUBLISHED_ACTIVE[model]}"
    )


@pytest.mark.parametrize("recipe", BIG_RECIPES, ids=lambda p: p.stem)
def test_every_cluster_recipe_fits_its_gpus(recipe: Path) -> None:
    result = plan(load_config(recipe), recipe.name)
    assert not result.problems
    assert result.fits, f"{recipe.name}: peak {result.peak_gib:.1f} GiB > {result.budget_gib:.1f} GiB usable"
    assert result.step_time_s > 0 and result.tokens_per_s_per_gpu > 0


UNSHARDED = [
    f"{role}.megatron={{tensor_model_parallel_size: 1, pipeline_model_parallel_size: 1, "
    "virtual_pipeline_model_parallel_size: null, sequence_parallel: false}"
    for role in ("actor", "critic", "ref")
]


def test_70b_without_model_parallelism_on_four_nodes_is_flagged_with_a_fitting_layout() -> None:
    """32 H100s hold 70B only split 32 ways with every idle state on the host (Adam's 16 bytes per parameter stay
    on the GPU in the role's own update and between iterations); one node holds it in no layout."""
    config = load_config(REPO / "recipes" / "llama3.1-70b.yaml", ["cluster.nodes=4", *UNSHARDED])
    result = plan(config)
    assert not result.fits and result.peak_gib > 500
    layout, fitting = suggest(config)
    assert fitting.fits and layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size == 32
    assert layout.param_offload and layout.grad_offload and layout.optimizer_offload
    one_node = load_config(REPO / "recipes" / "llama3.1-70b.yaml", ["cluster.nodes=1", *UNSHARDED])
    assert suggest(one_node) is None


def test_more_memory_per_parameter_with_a_replicated_optimizer() -> None:
    sharded = plan(load_config(REPO / "recipes" / "qwen2.5-32b.yaml"))
    replicated = plan(load_config(REPO / "recipes" / "qwen2.5-32b.yaml", [
        f"{r}.megatron.use_distributed_optimizer=false" for r in ("actor", "critic")]))  # fmt: skip
    assert replicated.roles["actor"].optimizer_gib == pytest.approx(2 * sharded.roles["actor"].optimizer_gib)


def test_plan_cli_json_for_scripts(tmp_path: Path, capsys) -> None:
    """The JSON report's parameter count is transformers' own for the model's published config.json."""
    status = main(["plan", str(REPO / "recipes" / "qwen3-32b.yaml"), "--json"])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    total, _ = transformers_counts(QWEN3_32B_CONFIG_JSON, tmp_path)
    assert report["fits"] and report["roles"]["actor"]["params"] == total


def test_overrides_may_follow_options(capsys) -> None:
    from megatron_ppo.cli import main

    recipe = str(REPO / "recipes" / "qwen2.5-7b.yaml")
    step_times = []
    for gpu in ("h100-80gb", "a100-80gb"):
        assert main(["plan", recipe, "--json", f"cluster.gpu_type={gpu}"]) == 0
        step_times.append(json.loads(capsys.readouterr().out)["step_time_s"])
    assert step_times[1] / step_times[0] == pytest.approx(989 / 312)  # same calibrated MFU, the peaks' ratio
    with pytest.raises(SystemExit):
        main(["plan", recipe, "--bogus"])


# Qwen/Qwen3-32B's config.json as published (transformers 4.51.0).
QWEN3_32B_CONFIG_JSON = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02,
    "intermediate_size": 25600, "max_position_embeddings": 40960, "max_window_layers": 64, "model_type": "qwen3",
    "num_attention_heads": 64, "num_hidden_layers": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}  # fmt: skip


def transformers_counts(config_json: dict, directory: Path) -> tuple[int, int]:
    """(every parameter, the routed experts') of the `transformers` model of a config.json, on the meta device."""
    import torch
    import transformers

    (directory / "config.json").write_text(json.dumps(config_json))
    with torch.device("meta"):  # shapes only
        hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    return hf.num_parameters(), sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("llama", True), ("qwen2", True), ("qwen3", False),
                                            ("qwen3_moe", False)])  # fmt: skip
def test_parameter_counts_equal_transformers_own_on_tiny_configs(tmp_path: Path, kind: str, tied: bool) -> None:
    """Every architecture variant the planner counts (tied or untied embeddings, Qwen2's QKV bias, Qwen3's QK norm
    and head_dim ≠ hidden/heads, Qwen3-MoE's router and experts), read from a config.json as `convert` reads it,
    against `transformers`' own `num_parameters()` of the same config."""
    from megatron_ppo.convert.huggingface import hf_model_config

    total, experts = transformers_counts(tiny_hf_config(kind, tied).to_dict(), tmp_path)
    model = hf_model_config(tmp_path)
    assert parameter_count(model) == total, f"{kind}: planner {parameter_count(model)} vs transformers {total}"
    assert expert_parameter_count(model) == experts, f"{kind}: experts {expert_parameter_count(model)} vs {experts}"


def test_qwen3_32b_parameter_count_equals_the_sum_over_its_config_json_shapes(tmp_path: Path) -> None:
    import torch
    import transformers

    from megatron_ppo.models.hf_conversion import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(QWEN3_32B_CONFIG_JSON))
    with torch.device("meta"):  # shapes only
        hf = transformers.Qwen3ForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    shapes_sum = sum(p.numel() for p in hf.parameters())
    model = load_config(REPO / "configs" / "models" / "qwen3-32b.yaml").model
    assert parameter_count(model) == shapes_sum, f"planner {parameter_count(model)} vs config.json {shapes_sum}"
    converted = model_config_from_hf(tmp_path)
    differing = {k: (getattr(model, k), v) for k, v in converted.items() if k != "name" and getattr(model, k) != v}
    assert not differing, f"configs/models/qwen3-32b.yaml differs from the published config.json: {differing}"


# Qwen/Qwen3-30B-A3B's and Qwen/Qwen3-235B-A22B's config.json as published (transformers 4.51.0).
_QWEN3_MOE_COMMON = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "norm_topk_prob": True, "num_experts": 128, "num_experts_per_tok": 8, "num_key_value_heads": 4,
    "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}  # fmt: skip
QWEN3_MOE_CONFIG_JSON = {
    "qwen3-moe-30b-a3b": {**_QWEN3_MOE_COMMON, "hidden_size": 2048, "intermediate_size": 6144,
                          "max_window_layers": 48, "moe_intermediate_size": 768, "num_attention_heads": 32,
                          "num_hidden_layers": 48},
    "qwen3-moe-235b-a22b": {**_QWEN3_MOE_COMMON, "hidden_size": 4096, "intermediate_size": 12288,
                            "max_window_layers": 94, "moe_intermediate_size": 1536, "num_attention_heads": 64,
                            "num_hidden_layers": 94},
}  # fmt: skip


@pytest.mark.parametrize("name", list(QWEN3_MOE_CONFIG_JSON))
def test_qwen3_moe_total_and_active_counts_equal_the_sums_over_config_json_shapes(tmp_path: Path, name: str) -> None:
    """Total: every tensor of `Qwen3MoeForCausalLM`; active: all but the (E − k)/E of the experts a token skips."""
    import torch
    import transformers

    from megatron_ppo.models.hf_conversion import model_config_from_hf

    config_json = QWEN3_MOE_CONFIG_JSON[name]
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    with torch.device("meta"):  # shapes only
        hf = transformers.Qwen3MoeForCausalLM(transformers.AutoConfig.from_pretrained(tmp_path))
    sizes = {n: p.numel() for n, p in hf.named_parameters()}
    experts = sum(n for key, n in sizes.items() if ".mlp.experts." in key)
    k, e = config_json["num_experts_per_tok"], config_json["num_experts"]
    model = load_config(REPO / "configs" / "models" / f"{name}.yaml").model
    assert parameter_count(model) == sum(sizes.values()), f"{name}: planner vs config.json {sum(sizes.values())}"
    assert expert_parameter_count(model) == experts
    assert active_parameter_count(model) == sum(sizes.values()) - experts + experts * k // e
    converted = model_config_from_hf(tmp_path)
    differing = {k: (getattr(model, k), v) for k, v in converted.items() if k != "name" and getattr(model, k) != v}
    assert not differing, f"configs/models/{name}.yaml differs from the published config.json: {differing}"


MOE_RECIPE = REPO / "recipes" / "qwen3-30b-a3b.yaml"


def _with_ep(ep: int, *more: str) -> list[str]:
    return [*(f"{r}.megatron.expert_model_parallel_size={ep}" for r in ("actor", "critic", "ref")), *more]


ONE_NODE = ["cluster.nodes=1", *_with_ep(8)]  # the arithmetic below is written for 8 GPUs


def test_expert_parallelism_shards_the_experts_and_their_optimizer_states_only(tmp_path: Path) -> None:
    """EP 8 → 4: each GPU holds twice the expert weights, the same dense ones; the experts' optimizer states are
    sharded by expert DP = world / (ETP·EP·PP) (8 / 4 = 2), the dense ones by DP 8. The counts: transformers' own,
    of the published config.json."""
    total, experts = transformers_counts(QWEN3_MOE_CONFIG_JSON["qwen3-moe-30b-a3b"], tmp_path)
    dense = total - experts
    by_ep = {ep: plan(load_config(MOE_RECIPE, [*ONE_NODE, *_with_ep(ep)])).roles["actor"] for ep in (4, 8)}
    for ep, role in by_ep.items():
        assert role.expert_params_per_gpu == experts // ep
        assert role.params_per_gpu == dense + experts // ep
        expected_optimizer = 12 * (dense / 8 + experts / ep / (8 // ep)) / 2**30
        assert role.optimizer_gib == pytest.approx(expected_optimizer), ep


def test_the_all_to_all_is_in_the_step_time_and_crosses_nodes_slower() -> None:
    """Per GPU and iteration: 27 passes (3 forwards, 2 × 4 epochs × 3 with full recompute) × T·L/world tokens ×
    k copies × 2h bytes × 2 (dispatch, combine) × 7/8 leaving the GPU at EP 8; none at EP 1. The same EP 8 over 2
    nodes of 4 GPUs runs at the InfiniBand bandwidth."""
    config = load_config(MOE_RECIPE, ONE_NODE)
    m, d = config.model, config.data
    tokens = d.train_batch_size * d.max_length
    expected_gb = 27 * tokens * m.num_layers / 8 * m.num_experts_per_tok * 2 * m.hidden_size * 2 * 7 / 8 / 1e9
    within, across = GPU_SPECS["h100-80gb"].all_to_all_gb_s
    ep8 = plan(config)
    assert ep8.all_to_all_gb_per_gpu == pytest.approx(expected_gb)
    assert ep8.all_to_all_s == pytest.approx(expected_gb / within)
    ep1 = plan(load_config(MOE_RECIPE, [*ONE_NODE, *_with_ep(1)]))
    assert ep1.all_to_all_gb_per_gpu == 0 and ep1.all_to_all_s == 0
    assert ep8.step_time_s - ep8.all_to_all_s == pytest.approx(ep1.step_time_s)
    spread = plan(load_config(MOE_RECIPE, [*ONE_NODE, "cluster.gpus_per_node=4", "cluster.nodes=2"]))
    assert spread.all_to_all_s == pytest.approx(expected_gb / across)


def test_moe_without_offload_on_one_node_is_flagged_with_a_fitting_expert_parallel_layout() -> None:
    on_gpu = [f"{r}.megatron.{k}=false" for r in ("actor", "critic") for k in ("param_offload", "optimizer_offload")]
    config = load_config(MOE_RECIPE, [*on_gpu, "ref.megatron.param_offload=false", "cluster.nodes=4", *_with_ep(1)])
    assert not plan(config).fits
    layout, fitting = suggest(config)
    assert fitting.fits and not fitting.problems and layout.expert_model_parallel_size > 1, fitting.layout


def test_each_phase_counts_what_the_offload_switches_leave_on_the_gpu() -> None:
    """With everything offloaded a role's update holds only that role's state and activations; a switch turned
    off adds that kind of the idle role to every phase that does not need it, and nothing to the others."""
    from megatron_ppo.planner.plan import RESERVED_GIB

    recipe = REPO / "recipes" / "qwen2.5-32b-1node.yaml"
    offloaded = plan(load_config(recipe))
    actor, critic, ref = (offloaded.roles[r] for r in ("actor", "critic", "ref"))
    assert offloaded.phases_gib["actor update"] == pytest.approx(
        actor.weights_gib + actor.grads_gib + actor.optimizer_gib + actor.activations_gib + RESERVED_GIB
    )
    resting = sum(r.weights_gib + r.optimizer_gib for r in (actor, critic, ref)) + RESERVED_GIB
    assert offloaded.phases_gib["between iterations"] == pytest.approx(resting)
    kept = plan(load_config(recipe, ["critic.megatron.grad_offload=false"]))
    added = {phase: kept.phases_gib[phase] - gib for phase, gib in offloaded.phases_gib.items()}
    grads = critic.grads_gib
    expected = {"experience": grads, "critic update": 0.0, "actor update": grads, "between iterations": grads}
    assert added == pytest.approx(expected)


def test_packed_micro_batches_are_counted_by_the_token_budget_padded_ones_by_rows_times_width() -> None:
    """qwen2.5-7b: a 16384-token budget packs one [1, 16384] pack; padded, it holds 5 full rows of 3072 tokens
    (15360): the activations (layers and log-probs, TP 4 on one pipeline stage) scale with those tokens."""
    from megatron_ppo.planner.plan import micro_batch_tokens

    recipe = REPO / "recipes" / "qwen2.5-7b.yaml"
    packed, padded = load_config(recipe), load_config(recipe, ["model.pack_sequences=false"])
    assert packed.model.pack_sequences and packed.actor.ppo_max_token_len_per_gpu == 16384
    assert micro_batch_tokens(packed, "actor", train=True) == (16384, 1)
    assert micro_batch_tokens(padded, "actor", train=True) == (5 * 3072, 5)
    ratio = plan(packed).roles["actor"].activations_gib / plan(padded).roles["actor"].activations_gib
    assert ratio == pytest.approx(16384 / 15360, rel=1e-12)


def _megatron_most_loaded_shard_bytes(config, dp: int) -> float:
    """Megatron-LM's megatron/training/theoretical_memory_usage.py, `compute_weight_and_optimizer_memory`, for an
    untied RMSNorm GPT without MoE at PP > 1: (the block / PP + one V·h embedding) / TP parameters on the most
    loaded shard, 6 + 12/DP bytes each with the distributed optimizer (bf16 weight, fp32 gradient, Adam's share)."""
    m, layout = config.model, config.actor.megatron
    h, a, g = m.hidden_size, m.num_attention_heads, m.num_query_groups
    d = m.kv_channels or h // a
    attention = 2 * h * h * ((1 + g / a) * (a * d / h))
    layer = 2 * h * (m.ffn_hidden_size * 3 / 2 + 1) + attention
    block = m.num_layers * layer + h
    shard = (block / layout.pipeline_model_parallel_size + h * m.vocab_size) / layout.tensor_model_parallel_size
    return shard * (6 + 12 / dp)


@pytest.mark.parametrize("name", ["qwen2.5-32b", "qwen3-32b", "qwen2.5-72b"])
def test_pp4_recipes_plan_the_most_loaded_stage_as_megatron_lm_counts_it(name: str) -> None:
    """The actor's weights + gradients + optimizer states are its last stage's (16 or 20 layers, the output layer
    and the final norm), equal within 0.1 % to Megatron-LM's closed form (which splits the norms by TP and leaves
    Qwen's QKV bias and QK norms out); an even split over TP·PP was 3.3–4.5 % under it."""
    from megatron_ppo.config.layout import data_parallel_size

    config = load_config(REPO / "recipes" / f"{name}.yaml")
    assert config.actor.megatron.pipeline_model_parallel_size == 4
    actor = plan(config).roles["actor"]
    planned = (actor.weights_gib + actor.grads_gib + actor.optimizer_gib) * 2**30
    expected = _megatron_most_loaded_shard_bytes(config, data_parallel_size(config, config.actor.megatron))
    assert planned == pytest.approx(expected, rel=1e-3)
    even = parameter_count(config.model) / (4 * config.actor.megatron.tensor_model_parallel_size)
    assert 0.03 < 1 - even * (6 + 12 / data_parallel_size(config, config.actor.megatron)) / expected < 0.05


def test_the_interleaved_schedule_adds_megatron_lms_in_flight_penalty() -> None:
    """llama3.1-70b (PP 4, 12 micro-batches of 16384 tokens a mini-batch, full recompute): with 5 virtual stages the
    first stage keeps 4 · (1 + 3/20) micro-batches of its 20 layers' inputs (Megatron-LM's interleaved penalty),
    without them 4; the recomputed layer's working set and the log-probs are the same."""
    from megatron_ppo.planner.plan import TE_KERNELS, layer_activation_bytes

    recipe = REPO / "recipes" / "llama3.1-70b.yaml"
    config = load_config(recipe)
    plain = load_config(recipe, [f"{role}.megatron.virtual_pipeline_model_parallel_size=null" for role in
                                 ("actor", "critic", "ref")])  # fmt: skip
    layer = layer_activation_bytes(config.model, config.actor.megatron, 16384, 1, kernels=TE_KERNELS, packed=True)
    assert layer == 16384 * 8192 * 2 / 8  # each layer's bf16 input, split by TP 8 under sequence parallelism
    added = (plan(config).roles["actor"].activations_gib - plan(plain).roles["actor"].activations_gib) * 2**30
    assert added == pytest.approx(layer * 20 * 4 * 3 / 20)
