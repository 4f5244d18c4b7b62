"""Hugging Face → Megatron → Hugging Face on random `transformers` Llama (GQA, untied), Qwen2 (QKV bias, tied), Qwen3
(QK layernorm, head_dim ≠ hidden/heads) and Llama-3.1-style (RoPE scaling) models: our Megatron model's logits equal
the `transformers` logits at TP 1, TP 2 and PP 2, whether converted in one process or sharded under TP 2 / PP 2 (each
rank reading only its share); the way back (`mcore_to_hf`, streaming a layer at a time into several safetensors
shards) gives the original weights bit for bit, from checkpoints saved at TP 1, TP 2, PP 2 and PP 2 × VPP 2 alike,
and holds one layer at a time; the trainer converts a recipe's `model.hf_checkpoint` on first use and caches it, and
its trained checkpoint exports; RoPE scaling Megatron cannot express is refused. A Qwen3-MoE (8 experts, top 2)
converts and verifies at EP 1/2 and TP 1/2, each EP rank reading only its own experts, and exports from each."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.convert.huggingface import Export, hf_logits, mcore_to_hf
from megatron_ppo.models.hf_conversion import SafetensorsReader, model_config_from_hf
from megatron_ppo.models.hf_shards import INDEX
from tests.distributed import conversion_workers
from tests.distributed.harness import run_distributed
from tests.support.hf_models import LLAMA31_ROPE, offline_recipe, save_hf_model

MODELS = {
    "llama-untied": ("llama", False, None),
    "qwen2-tied": ("qwen2", True, None),
    "qwen3-untied": ("qwen3", False, None),
    "llama3.1-rope-scaled": ("llama", False, LLAMA31_ROPE),
}
LAYOUTS = {
    "tp1": (1, MegatronConfig()),
    "tp2": (2, MegatronConfig(tensor_model_parallel_size=2)),
    "pp2": (2, MegatronConfig(pipeline_model_parallel_size=2)),
}


def _export_each(hf_dir: Path, checkpoints: dict[str, Path], root: Path) -> dict[str, Export]:
    """`mcore_to_hf` of each checkpoint (in this process: it needs no process group), with shards of a quarter of
    the model's bytes, so that the output is several files and an index."""
    quarter = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors")) // 4
    return {name: mcore_to_hf(path, hf_dir, root / f"hf-from-{name}", max_shard_bytes=quarter)
            for name, path in checkpoints.items()}  # fmt: skip


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory) -> dict:
    """Two multi-process runs per model: one process (convert, verify, what a whole conversion reads), then two
    processes re-laid out through TP 2 and PP 2 (verify the one-process conversion there, convert there, and verify
    those conversions back at TP 1); then each of the three conversions exported back to Hugging Face."""
    kind, tied, rope = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = save_hf_model(kind, root / "hf", tied, rope)
    single = run_distributed(conversion_workers.in_one_process, 1, str(hf_dir), str(root))[0]
    parallel = {name: LAYOUTS[name][1] for name in ("tp2", "pp2")}
    ranks = run_distributed(conversion_workers.dense_under_layouts, 2, str(hf_dir), single["megatron"], str(root),
                            parallel)  # fmt: skip
    checkpoints = {"tp1": Path(single["megatron"]), **{name: root / f"megatron-{name}" for name in parallel}}
    return {"name": request.param, "hf": str(hf_dir), "megatron": single["megatron"], "root": root,
            "single": single, "ranks": ranks, "exports": _export_each(hf_dir, checkpoints, root)}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_converted_logits_equal_transformers(converted, layout: str) -> None:
    if layout == "tp1":
        differences = [converted["single"]["difference"]]
    else:
        differences = [report["at"][layout] for report in converted["ranks"] if report["at"][layout] is not None]
    assert differences, "no rank held the last pipeline stage"
    assert max(differences) < 1e-4, f"{converted['name']} at {layout}: logits differ by {max(differences):.2e}"


def _round_trip_logits(hf_dir: str | Path, export: Export) -> float:
    input_ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    return float((hf_logits(export.path, input_ids) - hf_logits(hf_dir, input_ids)).abs().max())


def test_megatron_to_hf_round_trip_gives_the_same_logits(converted) -> None:
    difference = _round_trip_logits(converted["hf"], converted["exports"]["tp1"])
    assert difference < 1e-5, f"{converted['name']}: HF → Megatron → HF logits differ by {difference:.2e}"


def _assert_sharded_and_unchanged(hf_dir: str | Path, export: Export) -> None:
    """The export is several safetensors files and an index as transformers writes them, and `from_pretrained`
    loads from it the original model's weights bit for bit (fp32)."""
    import transformers

    original = SafetensorsReader(hf_dir)
    index = json.loads((export.path / INDEX).read_text())
    assert len(export.files) >= 3 and sorted(p.name for p in export.path.glob("*.safetensors")) == list(export.files)
    assert set(index["weight_map"]) == set(original.files) and set(index["weight_map"].values()) == set(export.files)
    sizes = {name: original.get(name).numel() for name in original.files}
    assert index["metadata"] == {"total_parameters": sum(sizes.values()), "total_size": 4 * sum(sizes.values())}
    ours, theirs = (transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).state_dict()
                    for d in (export.path, hf_dir))  # fmt: skip
    assert set(ours) == set(theirs)
    changed = [name for name in theirs if not torch.equal(ours[name], theirs[name])]
    assert not changed, f"{export.path}: {changed} differ from the original"


def test_the_export_is_sharded_and_transformers_loads_the_original_weights(converted) -> None:
    _assert_sharded_and_unchanged(converted["hf"], converted["exports"]["tp1"])


def _assert_one_layer_at_a_time(hf_dir: str | Path, export: Export, num_layers: int) -> None:
    """The most the export held at once is one layer's weights (as many bytes as the original's layer 0), well under
    the model's bytes / (layers / 2)."""
    original = SafetensorsReader(hf_dir)
    layer = sum(4 * original.get(name).numel() for name in original.files if name.startswith("model.layers.0."))
    assert export.largest_group_bytes == layer, (export.largest_group_bytes, layer, export.total_bytes)
    assert export.largest_group_bytes < export.total_bytes / (num_layers / 2)


def test_the_export_holds_one_layer_at_a_time(converted) -> None:
    _assert_one_layer_at_a_time(converted["hf"], converted["exports"]["tp1"], num_layers=4)


def _assert_same_weights(hf_dir: str | Path, export: Export) -> None:
    original, ours = SafetensorsReader(hf_dir), SafetensorsReader(export.path)
    assert set(ours.files) == set(original.files)
    changed = [name for name in original.files if not torch.equal(ours.get(name), original.get(name))]
    assert not changed, f"{export.path}: {changed} differ from the original"


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_a_checkpoint_saved_under_tp2_or_pp2_exports_the_original_weights(converted, layout: str) -> None:
    _assert_same_weights(converted["hf"], converted["exports"][layout])


def test_a_checkpoint_saved_with_virtual_pipeline_stages_exports_the_original_weights(tmp_path: Path) -> None:
    """Virtual stages number each chunk's layers from 0 (`layer_number` is global): the export must still put every
    layer back in its place."""
    hf_dir = save_hf_model("llama", tmp_path / "hf", tied=False)
    layout = MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    saved = run_distributed(conversion_workers.saved_under, 2, str(hf_dir), str(tmp_path / "megatron"), layout)[0]
    _assert_same_weights(hf_dir, mcore_to_hf(Path(saved).parent, hf_dir, tmp_path / "back"))


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_converting_under_a_parallel_layout_gives_the_same_model(converted, layout: str) -> None:
    # verified at TP 1 PP 1 over the same two ranks (data parallel): the first data-parallel rank reports
    differences = [r["converted"][layout] for r in converted["ranks"] if r["converted"][layout] is not None]
    assert differences, "no rank reported the verification"
    largest = max(differences)
    assert largest < 1e-4, f"{converted['name']} converted at {layout}: logits differ by {largest:.2e}"


def test_each_rank_reads_and_holds_only_its_share(converted) -> None:
    hf_dir = Path(converted["hf"])
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        total = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118
    whole = converted["single"]["reads"]
    assert whole[0] == total
    for report in converted["ranks"]:
        read, params = report["reads"]["pp2"]
        assert read < 0.7 * total and params < 0.7 * whole[1], (read, params, total, whole)
        read, params = report["reads"]["tp2"]  # each TP rank reads only its rows or columns of the split weights
        assert read < 0.6 * total and params < 0.6 * whole[1], (read, params, total, whole)


# The trainer's convert-on-first-use does not depend on the architecture (the table does): the two original models.
TRAINER_MODELS = pytest.mark.parametrize("converted", ["llama-untied", "qwen2-tied"], indirect=True)


@pytest.mark.parametrize("converted", ["llama-untied"], indirect=True)
def test_an_export_with_another_models_config_is_refused(converted, tmp_path: Path) -> None:
    qwen3, tied = save_hf_model("qwen3", tmp_path / "qwen3", False), save_hf_model("qwen2", tmp_path / "qwen2", True)
    with pytest.raises(ConfigError, match=r"linear_proj\.weight is \(64, 64\), the config's model has \(64, 128\)"):
        mcore_to_hf(converted["megatron"], qwen3, tmp_path / "out")
    with pytest.raises(ConfigError, match=r"tie_word_embeddings=True, but .* holds an output layer"):
        mcore_to_hf(converted["megatron"], tied, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("converted", ["llama-untied"], indirect=True)
def test_the_export_is_written_in_the_dtype_the_config_declares(converted, tmp_path: Path) -> None:
    """An fp32 checkpoint exported under a bfloat16 config.json: each tensor is the original rounded to bfloat16."""
    config = json.loads((Path(converted["hf"]) / "config.json").read_text())
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    export = mcore_to_hf(converted["megatron"], tmp_path / "bf16", tmp_path / "out")
    original, ours = SafetensorsReader(converted["hf"]), SafetensorsReader(export.path)
    assert export.total_bytes == sum(2 * original.get(name).numel() for name in original.files)
    changed = [n for n in original.files if not torch.equal(ours.get(n), original.get(n).to(torch.bfloat16))]
    assert not changed, changed


# The actor under Megatron's distributed optimizer, the critic under the plain one: the trained checkpoint holds both
# kinds of optimizer state (the first under `actor.`), which the export must leave out.
DISTRIBUTED_ACTOR = ["actor.megatron.use_distributed_optimizer=true"]


@TRAINER_MODELS
def test_the_trainer_converts_on_first_use_under_its_layout_and_caches(converted) -> None:
    root = converted["root"] / "first-use"
    root.mkdir()
    recipe = str(offline_recipe(root, Path(converted["hf"]), tp=2))
    assert run_distributed(conversion_workers.train_recipe, 2, recipe, DISTRIBUTED_ACTOR) == [1, 1]
    cache = root / "ckpt" / "hf_init" / "step_0"
    (difference,) = run_distributed(
        conversion_workers.logit_difference, 1, converted["hf"], str(cache.parent), MegatronConfig()
    )
    assert difference < 1e-4, f"the trainer's conversion differs from transformers by {difference:.2e}"
    written = cache.stat().st_mtime_ns
    run_distributed(conversion_workers.train_recipe, 2, recipe, [*DISTRIBUTED_ACTOR, "trainer.total_training_steps=2"])
    assert cache.stat().st_mtime_ns == written, "the cached conversion was redone"
    # the trained actor (saved at TP 2, beside the critic and both optimizers) exports, and transformers computes
    # the checkpoint's logits from the export
    exported = mcore_to_hf(root / "ckpt", converted["hf"], root / "trained-hf").path
    (difference,) = run_distributed(conversion_workers.logit_difference, 1, str(exported), str(root / "ckpt"),
                                    MegatronConfig())  # fmt: skip
    assert difference < 1e-5, f"the trained checkpoint's export differs from it by {difference:.2e}"


@TRAINER_MODELS
def test_a_recipe_that_disagrees_with_the_checkpoint_is_refused(converted) -> None:
    root = converted["root"] / "mismatch"
    root.mkdir()
    recipe = str(offline_recipe(root, Path(converted["hf"]), tp=1))
    with pytest.raises(AssertionError, match=r"model\.hidden_size=128, but .*config\.json says 64"):
        run_distributed(conversion_workers.train_recipe, 1, recipe, ["model.hidden_size=128"])


def test_the_rope_scaled_test_model_depends_on_its_scaling(tmp_path: Path) -> None:
    """The llama3.1 parity above is a test of the scaling: without it the same weights give other logits."""
    scaled = save_hf_model("llama", tmp_path / "scaled", False, LLAMA31_ROPE)
    plain = save_hf_model("llama", tmp_path / "plain", False, {"rope_type": "default",
                                             "rope_theta": LLAMA31_ROPE["rope_theta"]})  # fmt: skip
    input_ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    difference = float((hf_logits(scaled, input_ids) - hf_logits(plain, input_ids)).abs().max())
    assert difference > 1e-2, f"dropping the RoPE scaling changes the logits by only {difference:.2e}"


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "linear", "longrope"])
def test_conversion_refuses_a_rope_type_megatron_cannot_express(tmp_path: Path, rope_type: str) -> None:
    hf_dir = save_hf_model("llama", tmp_path, False, LLAMA31_ROPE)
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = rope_type
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"rope_parameters\.rope_type='{rope_type}' is not supported"):
        model_config_from_hf(hf_dir)


def test_conversion_reads_llama31_and_qwen3_configs_as_megatron_expresses_them(tmp_path: Path) -> None:
    llama = model_config_from_hf(save_hf_model("llama", tmp_path / "llama", False, LLAMA31_ROPE))
    qwen3 = model_config_from_hf(save_hf_model("qwen3", tmp_path / "qwen3", False))
    assert (llama["rope_scaling_factor"], llama["rotary_base"], llama["qk_layernorm"]) == (8.0, 500000.0, False)
    assert (qwen3["qk_layernorm"], qwen3["add_qkv_bias"], qwen3["kv_channels"]) == (True, False, 32)
    assert qwen3["rope_scaling_factor"] is None


# Expert parallel; TP 2 with the experts split by expert TP = TP; both, with expert TP 1 (Megatron's expert groups
# fold EP 2 into the same 2 ranks as TP 2).
MOE_LAYOUTS = {
    "ep2": MegatronConfig(expert_model_parallel_size=2),
    "tp2": MegatronConfig(tensor_model_parallel_size=2),
    "tp2-ep2-etp1": MegatronConfig(
        tensor_model_parallel_size=2, expert_model_parallel_size=2, expert_tensor_parallel_size=1
    ),
}


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> dict:
    """Two multi-process runs in all: one process (convert, verify), then two processes re-laid out through
    `MOE_LAYOUTS` (convert under each, verify each conversion under another layout); then each conversion exported
    back to Hugging Face."""
    root = tmp_path_factory.mktemp("qwen3-moe")
    hf_dir = save_hf_model("qwen3_moe", root / "hf", False)
    single = run_distributed(conversion_workers.in_one_process, 1, str(hf_dir), str(root))[0]
    ranks = run_distributed(
        conversion_workers.moe_under_layouts, 2, str(hf_dir), single["megatron"], str(root), MOE_LAYOUTS
    )
    checkpoints = {"one process": Path(single["megatron"]), **{name: root / f"megatron-{name}" for name in MOE_LAYOUTS}}
    return {"hf": hf_dir, "single": single, "ranks": ranks, "exports": _export_each(hf_dir, checkpoints, root)}


def test_qwen3_moe_converted_in_one_process_equals_transformers_both_ways(moe) -> None:
    assert moe["single"]["difference"] < 1e-4, f"Qwen3-MoE logits differ by {moe['single']['difference']:.2e}"
    round_trip = _round_trip_logits(moe["hf"], moe["exports"]["one process"])
    assert round_trip < 1e-5, f"HF → Megatron → HF differs by {round_trip:.2e}"


def test_qwen3_moe_exports_sharded_one_layer_at_a_time_from_every_layout(moe) -> None:
    """Every expert of every layer comes back bit for bit, whichever EP/TP layout saved the checkpoint."""
    _assert_sharded_and_unchanged(moe["hf"], moe["exports"]["one process"])
    _assert_one_layer_at_a_time(moe["hf"], moe["exports"]["one process"], num_layers=4)
    for layout in MOE_LAYOUTS:
        _assert_same_weights(moe["hf"], moe["exports"][layout])


def test_qwen3_moe_converted_under_ep_and_tp_verifies_under_another_layout(moe) -> None:
    verified = moe["ranks"][0]["verified"]  # rank 0 reports (first TP and DP rank, last stage)
    assert [(under, at) for under, at, _ in verified] == [
        ("one process", "ep2"), ("ep2", "tp2"), ("tp2", "tp2-ep2-etp1"), ("tp2-ep2-etp1", "ep2")
    ]  # fmt: skip
    for under, at, difference in verified:
        assert difference < 1e-4, f"converted under {under}, verified at {at}: logits differ by {difference:.2e}"


def _expert_of(name: str) -> int | None:
    match = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    return int(match[1]) if match else None


def test_each_ep_rank_reads_only_its_own_experts(moe) -> None:
    """EP 2: rank r reads every tensor outside the experts whole and, of the experts, exactly its own, 4r..4r+3."""
    with safe_open(str(Path(moe["hf"]) / "model.safetensors"), framework="pt") as f:
        sizes = {k: f.get_slice(k).get_shape() for k in f.keys()}  # noqa: SIM118
    nbytes = {k: 4 * torch.Size(shape).numel() for k, shape in sizes.items()}  # fp32
    total = sum(nbytes.values())
    whole_read, whole_params = moe["single"]["reads"]
    assert whole_read == total
    for rank, report in enumerate(moe["ranks"]):
        own = range(4 * rank, 4 * rank + 4)
        expected = sum(n for k, n in nbytes.items() if _expert_of(k) is None or _expert_of(k) in own)
        read, params = report["reads"]["ep2"]
        assert read == expected, f"EP rank {rank} read {read} bytes, its share is {expected} (total {total})"
        assert params < 0.7 * whole_params, (rank, params, whole_params)
        for layout in ("tp2", "tp2-ep2-etp1"):  # TP 2 splits the rest too, EP 2 or expert TP 2 the experts
            read, params = report["reads"][layout]
            assert read < 0.6 * total and params < 0.6 * whole_params, (layout, rank, read, total)
