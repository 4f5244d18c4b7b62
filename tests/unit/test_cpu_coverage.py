"""Every layout and feature flag a shipped recipe sets is either run by a named CPU test or named in the one list
of what cannot run on CPU (`config/gpu_only.py`), which the README's table repeats."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_ppo.config.compose import load_config
from megatron_ppo.config.gpu_only import CUDA_BRANCHES, GPU_ONLY
from megatron_ppo.config.schema import MegatronConfig, ModelConfig, PPOConfig

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
PARITY = "tests/distributed/test_parallel_parity.py"
EXPERTS = "tests/distributed/test_expert_parallel_parity.py"
OFFLOAD = "tests/distributed/test_host_offload.py::test_an_offloaded_run_equals_one_without_offload"
SMOKE = "tests/e2e/test_recipe_smoke.py"
# flag → the CPU test that runs it (through the trainer's own path, against a reference)
CPU_TESTED = {
    "megatron.tensor_model_parallel_size": f"{PARITY}::test_grad_norm_and_updated_weights_match_single_process",
    "megatron.sequence_parallel": f"{PARITY}::test_sequence_parallel_parity_runs_micro_batch_widths_tp_does_not_divide",
    "megatron.pipeline_model_parallel_size": f"{PARITY}::test_grad_norm_and_updated_weights_match_single_process",
    "megatron.virtual_pipeline_model_parallel_size": f"{PARITY}::test_value_head_lives_only_on_the_last_stage",
    "megatron.use_distributed_optimizer": "tests/distributed/test_data_parallel_overlap.py::"
    "test_out_of_memory_in_a_backward_is_retried_and_equals_a_run_without_it",
    **dict.fromkeys(
        ("megatron.recompute_granularity", "megatron.recompute_method", "megatron.recompute_num_layers"),
        f"{PARITY}::test_activation_recompute_runs_the_forward_again_in_the_backward",
    ),
    **dict.fromkeys(("megatron.param_offload", "megatron.grad_offload", "megatron.optimizer_offload"), OFFLOAD),
    "megatron.expert_model_parallel_size": f"{EXPERTS}::test_grad_norm_and_updated_weights_match_ep1",
    "megatron.expert_tensor_parallel_size": f"{EXPERTS}::test_grad_norm_and_updated_weights_match_ep1",
    "model.num_experts": f"{EXPERTS}::test_grad_norm_and_updated_weights_match_ep1",
    "model.moe_token_dispatcher=allgather": f"{EXPERTS}::test_grad_norm_and_updated_weights_match_ep1",
    # through the CLI with each recipe's layout (with EP and the allgather dispatcher too), resumed and compared
    "use_dynamic_bsz": f"{SMOKE}::test_recipe_trains_saves_and_resumes_through_the_cli",
}


def recipe_flags(config: PPOConfig) -> set[str]:
    """The layout and feature flags `config` sets away from the defaults: every `{role}.megatron` key, the MoE and
    kernel choices of the model, dynamic batch sizes."""
    flags = {
        f"megatron.{field.name}"
        for role in ("actor", "ref", "critic")
        for field in dataclasses.fields(MegatronConfig)
        if getattr(getattr(config, role).megatron, field.name) != getattr(MegatronConfig(), field.name)
    }
    if config.model.num_experts:
        flags |= {"model.num_experts", f"model.moe_token_dispatcher={config.model.moe_token_dispatcher}"}
    if config.model.transformer_impl != ModelConfig().transformer_impl:
        flags.add(f"model.transformer_impl={config.model.transformer_impl}")
    if config.actor.use_dynamic_bsz or config.critic.use_dynamic_bsz:
        flags.add("use_dynamic_bsz")
    return flags


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.name)
def test_every_recipe_flag_is_cpu_tested_or_listed_as_gpu_only(recipe: Path) -> None:
    config = load_config(recipe, [])
    listed = {entry.setting for entry in GPU_ONLY if entry.present(config)}
    uncovered = [
        flag for flag in sorted(recipe_flags(config))
        if flag not in CPU_TESTED and not any(setting.startswith(flag) for setting in listed)
    ]  # fmt: skip
    assert not uncovered, (f"{recipe.name} sets {uncovered}: add a CPU test (and name it in CPU_TESTED) or an entry "
                           "in megatron_ppo/config/gpu_only.py")  # fmt: skip


def test_the_named_cpu_tests_exist() -> None:
    for flag, node in CPU_TESTED.items():
        path, name = node.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{flag}: {node} does not exist"


def test_readme_lists_every_gpu_only_setting_with_its_gpu_check_part() -> None:
    readme = (REPO / "README.md").read_text()
    for entry in GPU_ONLY:
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{entry.setting}`")), None)
        assert row is not None and entry.gpu_check in row, f"README's GPU-only table lacks {entry.setting}"


def test_every_cuda_branch_names_cpu_tests_that_exist_and_the_readme_lists_it() -> None:
    readme = (REPO / "README.md").read_text()
    for branch in CUDA_BRANCHES:
        nodes = [part.strip().split(" ")[0] for part in branch.test.split(";")]
        for node in nodes:
            path, _, name = node.partition("::")
            text = (REPO / path).read_text()
            assert not name or re.search(rf"^def {name}\(", text, re.M), f"{branch.where}: {node} does not exist"
        assert branch.where.split(":")[0] in readme and nodes[0].split("::")[-1] in readme, branch.where
