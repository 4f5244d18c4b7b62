"""Every layout and feature flag a shipped recipe sets is either run by a named CPU test or named in the one list
of what cannot run on CPU (`config/gpu_only.py`), which the guide's table (docs/gpu.md) repeats."""

from __future__ import annotations

import ast
import dataclasses
import re
from functools import cache
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
    "megatron.sequence_parallel": f"{PARITY}::test_sequence_parallel_splits_micro_batches_over_tp_padding_odd_widths",
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


@cache
def _module(path: Path) -> tuple[str, dict[str, ast.AST], dict[str, tuple[Path, str | None]]]:
    """A test module's source, its top-level definitions by name, and the names it imports from `tests.*`: name →
    (the module's file, the name in it; None when the name is the module itself)."""
    source = path.read_text()
    definitions: dict[str, ast.AST] = {}
    imports: dict[str, tuple[Path, str | None]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            definitions[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for name in ast.walk(target):
                    if isinstance(name, ast.Name):
                        definitions[name.id] = node
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "tests":
            base = REPO.joinpath(*node.module.split("."))
            for alias in node.names:
                as_module = base / f"{alias.name}.py"
                imports[alias.asname or alias.name] = (as_module, None) if as_module.is_file() else (
                    base.with_suffix(".py"), alias.name)  # fmt: skip
    return source, definitions, imports


def exercised_source(path: Path, name: str) -> str:
    """The source a test runs in the test tree: its definition (decorators and parametrisation included) and,
    transitively, every top-level definition it names there — its fixtures, the layouts it is parametrised by, the
    worker functions and helpers of `tests.*` modules it calls — but no package code. Of a module's `LAYOUTS`, a
    test parametrised by layout names takes only the layouts it names."""
    seen: set[tuple[Path, str]] = set()
    todo, parts = [(path, name)], []
    source, definitions, _ = _module(path)
    layouts = definitions.get("LAYOUTS")
    if isinstance(layouts, ast.Assign) and isinstance(layouts.value, ast.Dict):
        # a test parametrised by some of the module's layouts (by name) runs those, not every one the fixture holds
        decorators = getattr(definitions[name], "decorator_list", [])
        named = {n.id for d in decorators for n in ast.walk(d) if isinstance(n, ast.Name)}
        entries = {key.value: value for key, value in zip(layouts.value.keys, layouts.value.values, strict=True)
                   if isinstance(key, ast.Constant)}  # fmt: skip
        chosen = {c.value for d in decorators for c in ast.walk(d) if isinstance(c, ast.Constant)} & set(entries)
        if chosen and "LAYOUTS" not in named:
            seen.add((path, "LAYOUTS"))
            parts += [ast.get_source_segment(source, entries[key]) or "" for key in sorted(chosen)]
    while todo:
        where, what = todo.pop()
        source, definitions, imports = _module(where)
        if (where, what) in seen or what not in definitions:
            continue
        seen.add((where, what))
        node = definitions[what]
        parts.append(ast.get_source_segment(source, node, padded=False) or "")
        decorators = getattr(node, "decorator_list", [])
        for child in [node, *decorators]:
            for sub in ast.walk(child):
                names = [sub.id] if isinstance(sub, ast.Name) else [sub.arg] if isinstance(sub, ast.arg) else []
                for used in names:  # a fixture is named by the test's argument
                    if used in definitions:
                        todo.append((where, used))
                    elif used in imports and imports[used][1] is not None:
                        todo.append(imports[used])  # type: ignore[arg-type]
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name):
                    module = imports.get(sub.value.id)
                    if module is not None and module[1] is None:
                        todo.append((module[0], sub.attr))
        parts.extend(ast.get_source_segment(source, d) or "" for d in decorators)
    return "\n".join(parts)


# A setting its test runs without naming it: the schema's default, under the feature it belongs to.
RUN_BY_DEFAULT = {"model.moe_token_dispatcher=allgather": "num_experts"}


def flag_evidence(flag: str) -> str:
    """What a test that runs `flag` must name: the key's last part, or for `key=value` the value."""
    if flag in RUN_BY_DEFAULT:
        key, _, value = flag.partition("=")
        assert getattr(ModelConfig(), key.removeprefix("model.")) == value, f"{flag} is no longer the default"
        return RUN_BY_DEFAULT[flag]
    key, _, value = flag.partition("=")
    return value or key.rsplit(".", 1)[-1]


@pytest.mark.parametrize("flag", CPU_TESTED)
def test_each_named_cpu_test_exercises_its_flag(flag: str) -> None:
    path, name = CPU_TESTED[flag].split("::")
    assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{flag}: {CPU_TESTED[flag]} does not exist"
    evidence = flag_evidence(flag)
    source = exercised_source(REPO / path, name)
    assert re.search(rf"\b{re.escape(evidence)}\b", source), (
        f"{flag}: {CPU_TESTED[flag]} never sets {evidence!r} (not in the test, its parametrisation, its fixtures or "
        "the test-tree workers it calls): name a test that runs the flag"
    )


def test_the_guide_lists_every_gpu_only_setting_with_its_gpu_check_part() -> None:
    readme = (REPO / "docs" / "gpu.md").read_text()
    for entry in GPU_ONLY:
        row = next((line for line in readme.splitlines() if line.startswith(f"| `{entry.setting}`")), None)
        assert row is not None and entry.gpu_check in row, f"docs/gpu.md's GPU-only table lacks {entry.setting}"


def test_every_cuda_branch_names_cpu_tests_that_exist_and_the_guide_lists_it() -> None:
    readme = (REPO / "docs" / "gpu.md").read_text()
    for branch in CUDA_BRANCHES:
        nodes = [part.strip().split(" ")[0] for part in branch.test.split(";")]
        for node in nodes:
            path, _, name = node.partition("::")
            text = (REPO / path).read_text()
            assert not name or re.search(rf"^def {name}\(", text, re.M), f"{branch.where}: {node} does not exist"
        assert branch.where.split(":")[0] in readme and nodes[0].split("::")[-1] in readme, branch.where
