"""Qwen3-MoE's config.json as our `model.*` keys (published and transformers-5 spellings), what the conversion
refuses, and the layouts `convert` accepts for a mixture of experts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.convert.huggingface import conversion_layout, hf_model_config, layout_problems
from megatron_ppo.models.hf_conversion import model_config_from_hf
from tests.support.hf_models import QWEN3_MOE, save_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return save_hf_model("qwen3_moe", tmp_path_factory.mktemp("qwen3-moe"), False)


def _with(hf_dir: Path, tmp_path: Path, **changes) -> Path:
    config = json.loads((hf_dir / "config.json").read_text())
    config.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_qwen3_moe_config_becomes_our_expert_keys(hf_dir: Path, tmp_path: Path) -> None:
    keys = model_config_from_hf(hf_dir)
    assert {k: keys[k] for k in QWEN3_MOE} == QWEN3_MOE
    assert (keys["qk_layernorm"], keys["add_qkv_bias"], keys["kv_channels"]) == (True, False, 32)
    assert "router_aux_loss_coef" not in keys  # a training setting: the recipe's
    # transformers 5 writes num_local_experts; the published checkpoints write num_experts
    written = json.loads((hf_dir / "config.json").read_text())
    published = {k: v for k, v in written.items() if k != "num_local_experts"} | {"num_experts": 6}
    (tmp_path / "config.json").write_text(json.dumps(published))
    assert model_config_from_hf(tmp_path)["num_experts"] == 6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
        ({"decoder_sparse_step": 2}, r"decoder_sparse_step=2 is not supported"),
    ],
)
def test_dense_layers_between_the_moe_layers_are_refused(hf_dir: Path, tmp_path: Path, change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        model_config_from_hf(_with(hf_dir, tmp_path, **change))


def test_convert_accepts_expert_parallel_layouts_and_names_the_fix_otherwise(hf_dir: Path) -> None:
    model = hf_model_config(hf_dir)  # 8 experts
    assert layout_problems(model, conversion_layout(model, tp=1, pp=2, ep=2)) == []
    assert layout_problems(model, conversion_layout(model, tp=1, pp=1, ep=8)) == []
    problems = layout_problems(model, conversion_layout(model, tp=1, pp=1, ep=3))
    assert any("expert_model_parallel_size=3" in p and "[1, 2, 4, 8]" in p for p in problems), problems
