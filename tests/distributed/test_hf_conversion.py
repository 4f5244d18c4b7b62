"""Hugging Face → Megatron → Hugging Face on random `transformers` Llama (GQA, untied), Qwen2 (QKV bias, tied), Qwen3
(QK layernorm, head_dim ≠ hidden/heads) and Llama-3.1-style (RoPE scaling) models: our Megatron model's logits equal
the `transformers` logits at TP 1, TP 2 and PP 2, whether converted in one process or sharded under TP 2 / PP 2 (each
rank reading only its share); the weights come back unchanged; the trainer converts a recipe's
`model.hf_checkpoint` on first use and caches it; RoPE scaling Megatron cannot express is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.convert import hf_logits
from megatron_ppo.models.hf_conversion import model_config_from_hf
from tests.distributed import conversion_workers
from tests.distributed.harness import run_distributed

MODELS = {
    "llama-untied": ("llama", False, None),
    "qwen2-tied": ("qwen2", True, None),
    "qwen3-untied": ("qwen3", False, None),
    "llama3.1-rope-scaled": ("llama", False, conversion_workers.LLAMA31_ROPE),
}
LAYOUTS = {
    "tp1": (1, MegatronConfig()),
    "tp2": (2, MegatronConfig(tensor_model_parallel_size=2)),
    "pp2": (2, MegatronConfig(pipeline_model_parallel_size=2)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory) -> dict:
    kind, tied, rope = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = conversion_workers.save_hf_model(kind, root / "hf", tied, rope)
    megatron_dir = run_distributed(conversion_workers.convert, 1, str(hf_dir), str(root / "megatron"))[0]
    return {"name": request.param, "hf": str(hf_dir), "megatron": megatron_dir, "root": root}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_converted_logits_equal_transformers(converted, layout: str) -> None:
    world, megatron_layout = LAYOUTS[layout]
    reports = run_distributed(
        conversion_workers.logit_difference, world, converted["hf"], converted["megatron"], megatron_layout
    )
    differences = [d for d in reports if d is not None]
    assert differences, "no rank held the last pipeline stage"
    assert max(differences) < 1e-4, f"{converted['name']} at {layout}: logits differ by {max(differences):.2e}"


def test_megatron_to_hf_round_trip_gives_the_same_logits(converted) -> None:
    difference = run_distributed(
        conversion_workers.round_trip, 1, converted["hf"], converted["megatron"], str(converted["root"] / "back")
    )[0]
    assert difference < 1e-5, f"{converted['name']}: HF → Megatron → HF logits differ by {difference:.2e}"


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_converting_under_a_parallel_layout_gives_the_same_model(converted, layout: str) -> None:
    world, megatron_layout = LAYOUTS[layout]
    out = str(converted["root"] / f"megatron-{layout}")
    run_distributed(conversion_workers.convert_at, world, converted["hf"], out, megatron_layout)
    (difference,) = run_distributed(conversion_workers.logit_difference, 1, converted["hf"], out, MegatronConfig())
    assert difference < 1e-4, f"{converted['name']} converted at {layout}: logits differ by {difference:.2e}"


def test_each_rank_reads_and_holds_only_its_share(converted) -> None:
    hf_dir = Path(converted["hf"])
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        total = sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in f.keys())  # noqa: SIM118
    whole = run_distributed(conversion_workers.shard_reads, 1, str(hf_dir), MegatronConfig())[0]
    stages = run_distributed(conversion_workers.shard_reads, 2, str(hf_dir), LAYOUTS["pp2"][1])
    tensor_parallel = run_distributed(conversion_workers.shard_reads, 2, str(hf_dir), LAYOUTS["tp2"][1])
    assert whole[0] == total
    for read, params in stages:
        assert read < 0.7 * total and params < 0.7 * whole[1], (read, params, total, whole)
    for read, params in tensor_parallel:  # each TP rank reads only its rows or columns of the split weights
        assert read < 0.6 * total and params < 0.6 * whole[1], (read, params, total, whole)


# The trainer's convert-on-first-use does not depend on the architecture (the table does): the two original models.
TRAINER_MODELS = pytest.mark.parametrize("converted", ["llama-untied", "qwen2-tied"], indirect=True)


@TRAINER_MODELS
def test_the_trainer_converts_on_first_use_under_its_layout_and_caches(converted) -> None:
    root = converted["root"] / "first-use"
    root.mkdir()
    recipe = str(conversion_workers.offline_recipe(root, Path(converted["hf"]), tp=2))
    assert run_distributed(conversion_workers.train_recipe, 2, recipe, []) == [1, 1]
    cache = root / "ckpt" / "hf_init" / "step_0"
    (difference,) = run_distributed(
        conversion_workers.logit_difference, 1, converted["hf"], str(cache.parent), MegatronConfig()
    )
    assert difference < 1e-4, f"the trainer's conversion differs from transformers by {difference:.2e}"
    written = cache.stat().st_mtime_ns
    run_distributed(conversion_workers.train_recipe, 2, recipe, ["trainer.total_training_steps=2"])
    assert cache.stat().st_mtime_ns == written, "the cached conversion was redone"


@TRAINER_MODELS
def test_a_recipe_that_disagrees_with_the_checkpoint_is_refused(converted) -> None:
    root = converted["root"] / "mismatch"
    root.mkdir()
    recipe = str(conversion_workers.offline_recipe(root, Path(converted["hf"]), tp=1))
    with pytest.raises(AssertionError, match=r"model\.hidden_size=128, but .*config\.json says 64"):
        run_distributed(conversion_workers.train_recipe, 1, recipe, ["model.hidden_size=128"])


def test_the_rope_scaled_test_model_depends_on_its_scaling(tmp_path: Path) -> None:
    """The llama3.1 parity above is a test of the scaling: without it the same weights give other logits."""
    scaled = conversion_workers.save_hf_model("llama", tmp_path / "scaled", False, conversion_workers.LLAMA31_ROPE)
    plain = conversion_workers.save_hf_model("llama", tmp_path / "plain", False, {"rope_type": "default",
                                             "rope_theta": conversion_workers.LLAMA31_ROPE["rope_theta"]})  # fmt: skip
    input_ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    difference = float((hf_logits(scaled, input_ids) - hf_logits(plain, input_ids)).abs().max())
    assert difference > 1e-2, f"dropping the RoPE scaling changes the logits by only {difference:.2e}"


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "linear", "longrope"])
def test_conversion_refuses_a_rope_type_megatron_cannot_express(tmp_path: Path, rope_type: str) -> None:
    hf_dir = conversion_workers.save_hf_model("llama", tmp_path, False, conversion_workers.LLAMA31_ROPE)
    config = json.loads((hf_dir / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = rope_type
    (hf_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=rf"rope_parameters\.rope_type='{rope_type}' is not supported"):
        model_config_from_hf(hf_dir)


def test_conversion_reads_llama31_and_qwen3_configs_as_megatron_expresses_them(tmp_path: Path) -> None:
    llama = model_config_from_hf(
        conversion_workers.save_hf_model("llama", tmp_path / "llama", False, conversion_workers.LLAMA31_ROPE)
    )
    qwen3 = model_config_from_hf(conversion_workers.save_hf_model("qwen3", tmp_path / "qwen3", False))
    assert (llama["rope_scaling_factor"], llama["rotary_base"], llama["qk_layernorm"]) == (8.0, 500000.0, False)
    assert (qwen3["qk_layernorm"], qwen3["add_qkv_bias"], qwen3["kv_channels"]) == (True, False, 32)
    assert qwen3["rope_scaling_factor"] is None
