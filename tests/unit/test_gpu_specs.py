"""One GPU table (`config/gpus.py`): `cluster.gpu_type` is one of its keys, and the planner, the measured MFU and the
GPU check's device lookup read their numbers from it, with no fallback for a type it does not know."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.gpus import GPU_SPECS, gpu_type_named
from megatron_ppo.planner.plan import MARGIN, plan
from megatron_ppo.train.throughput import throughput_metrics

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "qwen2.5-7b.yaml"


def test_an_unknown_gpu_type_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(RECIPE, ["cluster.gpu_type=v100-32gb"])
    (problem,) = refused.value.problems
    assert problem.startswith("cluster.gpu_type='v100-32gb' is not one of") and all(k in problem for k in GPU_SPECS)


@pytest.mark.parametrize("cluster_yaml", sorted((REPO / "configs" / "clusters").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_cluster_config_names_a_spec_and_plans_against_its_memory(cluster_yaml: Path) -> None:
    config = load_config(RECIPE, [f"cluster.gpu_type={load_config(cluster_yaml).cluster.gpu_type}"])
    spec = GPU_SPECS[config.cluster.gpu_type]
    result = plan(config)
    assert result.budget_gib == pytest.approx(spec.memory_gib * (1 - MARGIN))
    override = plan(load_config(RECIPE, [f"cluster.gpu_type={config.cluster.gpu_type}", "cluster.gpu_memory_gib=40"]))
    assert override.budget_gib == pytest.approx(40 * (1 - MARGIN))


def test_step_time_and_measured_mfu_use_the_spec_peak_and_assumed_mfu() -> None:
    h100, h200 = (plan(load_config(RECIPE, [f"cluster.gpu_type={gpu}"])) for gpu in ("h100-80gb", "h200-141gb"))
    assert h200.step_time_s == pytest.approx(h100.step_time_s)  # same peak and MFU: H200 no longer plans at a fallback
    config = load_config(RECIPE, ["cluster.gpu_type=a100-80gb"])
    metrics = throughput_metrics(config, ("actor",), [100], {"update_actor": 1.0, "iteration": 1.0})
    assert metrics["perf/mfu/actor"] == pytest.approx(metrics["perf/tflops_per_gpu"] / 312.0)


def test_device_names_map_to_their_spec_and_an_unknown_device_is_an_error() -> None:
    assert gpu_type_named("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert gpu_type_named("NVIDIA H200") == "h200-141gb"
    assert gpu_type_named("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    with pytest.raises(ValueError, match=r"no GPU spec for 'Tesla V100-SXM2-32GB'.*h100-80gb"):
        gpu_type_named("Tesla V100-SXM2-32GB")
