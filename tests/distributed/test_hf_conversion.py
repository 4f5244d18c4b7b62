"""Hugging Face → Megatron → Hugging Face on random `transformers` Llama (GQA, untied) and Qwen2 (QKV bias, tied)
models: our Megatron model's logits equal the `transformers` logits at TP 1, TP 2 and PP 2, and the weights come
back unchanged."""

from __future__ import annotations

import pytest

from megatron_ppo.config.schema import MegatronConfig
from tests.distributed import conversion_workers
from tests.distributed.harness import run_distributed

MODELS = {"llama-untied": ("llama", False), "qwen2-tied": ("qwen2", True)}
LAYOUTS = {
    "tp1": (1, MegatronConfig()),
    "tp2": (2, MegatronConfig(tensor_model_parallel_size=2)),
    "pp2": (2, MegatronConfig(pipeline_model_parallel_size=2)),
}


@pytest.fixture(scope="module", params=list(MODELS))
def converted(request, tmp_path_factory) -> dict:
    kind, tied = MODELS[request.param]
    root = tmp_path_factory.mktemp(request.param)
    hf_dir = conversion_workers.save_hf_model(kind, root / "hf", tied)
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
