"""The package's imports point one way: algo → config → data/parallel/planner → models → checkpoint → convert →
train → runs → tasks → cli.

Every `import` in every module (function-level ones too) is read with `ast` and checked against the layer order,
so an upward arrow fails here rather than in a review. Two rules beside the order: the planner itself
(`planner/plan.py`) is the command line's alone (runtime code shares its phase table and FLOP count,
`planner/phases.py` and `planner/flops.py`, never imports it), and
Megatron is touched by `models/` and `parallel/`, outside them only through the public APIs in `MEGATRON_OUTSIDE`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_ppo"

# Lower layers never import higher ones; modules of one layer may import each other.
LAYERS: dict[str, int] = {
    "startup": 0,  # run by the package's __init__ before anything else of it: the standard library and torch only
    "algo": 0,
    "config": 1,
    "data": 2,
    "parallel": 2,
    "planner": 2,  # its `plan` is the command line's alone (test below)
    "models": 3,
    "checkpoint": 4,
    "convert": 5,
    "train": 6,
    "runs": 7,
    "tasks": 8,
    "launcher": 8,  # `train --nproc`: the command line's workers, and what they tell the user
    "cli": 9,
    "__main__": 9,
}


# Megatron modules used outside models/ and parallel/ (everything else of Megatron's, its process-group state
# `parallel_state` above all, is reached through those two: `parallel/ranks.py` for this rank's place in the groups).
MEGATRON_OUTSIDE = {
    "megatron_ppo.checkpoint.async_save": {"megatron.core.dist_checkpointing.strategies.async_utils"},  # its writers
    "megatron_ppo.checkpoint.directory": {"megatron.core.dist_checkpointing"},  # is a directory Megatron's checkpoint
    "megatron_ppo.checkpoint.store": {"megatron.core.dist_checkpointing", "megatron.core.tensor_parallel",
                                "megatron.core.dist_checkpointing.validation",
                                "megatron.core.dist_checkpointing.mapping",
                                "megatron.core.dist_checkpointing.dict_utils",
                                "megatron.core.optimizer.distrib_optimizer"},  # saving and loading: its format
    "megatron_ppo.data.prepared": {"megatron.core.datasets.indexed_dataset"},  # the prepared rows' token files
    "megatron_ppo.convert.critic_init": {"megatron.core.dist_checkpointing"},  # the roles a checkpoint's metadata holds
    "megatron_ppo.convert.huggingface": {"megatron.core.tensor_parallel"},  # the TP gather of the logits `verify` uses
    "megatron_ppo.train.optimizer": {"megatron.core.distributed", "megatron.core.optimizer",
                                     "megatron.core.optimizer.clip_grads", "megatron.core.optimizer_param_scheduler"},
}  # fmt: skip


def _unit(module: str) -> str:
    """The layer unit of a dotted module name inside the package (`megatron_ppo.train.ppo` → `train`)."""
    return module.split(".")[1] if "." in module else ""


def _imports(path: Path, importer: str) -> list[tuple[int, str]]:
    """(line, module) of every import in `path` (module `importer`), relative imports resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = importer.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            found.append((node.lineno, base))
            # `from megatron_ppo.planner import plan` imports the submodule `plan` (a name that is no module
            # adds a dotted name no rule matches)
            if base == "megatron_ppo" or base.startswith("megatron_ppo."):
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations_in(path: Path, importer: str) -> list[str]:
    """The imports of module `importer` (source `path`) that break the layer order."""
    unit, problems, seen = _unit(importer), [], set()
    for line, module in _imports(path, importer):
        if (line, _unit(module)) in seen:  # `from megatron_ppo.train import ppo`: the package and its submodule
            continue
        seen.add((line, _unit(module)))
        if unit == "algo" and not module.startswith("megatron_ppo"):
            top = module.split(".")[0]
            if top not in ("torch", "__future__") and top not in sys.stdlib_module_names:
                problems.append(f"{importer}:{line}: algo/ imports only torch, not {module}")
        elif module.startswith("megatron_ppo.") and LAYERS.get(_unit(module), -1) > LAYERS[unit]:
            problems.append(
                f"{importer}:{line}: {unit} (layer {LAYERS[unit]}) imports {module} (layer {LAYERS[_unit(module)]})"
            )
    return problems


def _violations() -> list[str]:
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        importer = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if _unit(importer) not in ("", "__init__"):
            problems += _violations_in(path, importer)
    return problems


def test_every_unit_of_the_package_has_a_layer() -> None:
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if not p.name.startswith("__py")}
    units -= {"__init__", "configs"}  # configs: the YAML package data (a link to the repository's configs/), no code
    assert units <= set(LAYERS), f"give these a layer in LAYERS: {sorted(units - set(LAYERS))}"


def test_no_import_runs_back_up_the_house() -> None:
    assert _violations() == []


def test_the_layer_check_catches_upward_and_foreign_imports(tmp_path: Path) -> None:
    """The checker itself: a models/ module importing train/ (also inside a function), and algo/ importing
    Megatron, are reported."""
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\ndef f():\n    from megatron_ppo.train import ppo\n")
    assert _violations_in(probe, "megatron_ppo.models.probe") == [
        "megatron_ppo.models.probe:4: models (layer 3) imports megatron_ppo.train (layer 6)"
    ]
    probe.write_text("import math\nimport torch\nfrom megatron.core import parallel_state\n")
    assert _violations_in(probe, "megatron_ppo.algo.probe") == [
        "megatron_ppo.algo.probe:3: algo/ imports only torch, not megatron.core"
    ]


def _megatron_imports(path: Path) -> set[str]:
    """The Megatron modules (and names imported from them, `megatron.core.parallel_state`) that `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("megatron.")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron."):
            found |= {f"{node.module}.{alias.name}" if node.module == "megatron.core" else node.module
                      for alias in node.names}  # fmt: skip
    return found


def test_only_models_and_parallel_touch_megatron(tmp_path: Path) -> None:
    """Outside `models/` and `parallel/` a module imports only the Megatron APIs `MEGATRON_OUTSIDE` lists for it."""
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if _unit(module) not in ("models", "parallel") and (imported := _megatron_imports(path)):
            outside[module] = imported
    assert outside == MEGATRON_OUTSIDE, "route Megatron through models/ or parallel/ (or list the API here, with why)"
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n\ndef f():\n    from megatron.core import parallel_state\n")
    assert _megatron_imports(probe) == {"megatron.core.parallel_state"}, "the reader misses a function-level import"


def test_only_the_command_line_imports_the_planner() -> None:
    importers = sorted(
        importer
        for path in PACKAGE.rglob("*.py")
        if (importer := ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)) != "megatron_ppo.planner.plan"
        for _, module in _imports(path, importer)
        if module == "megatron_ppo.planner.plan"
    )
    assert importers == ["megatron_ppo.cli"], f"runtime code imports the planner: {importers}"


def test_the_trainer_never_names_the_demo_task() -> None:
    train = PACKAGE / "train"
    named = [p.name for p in train.glob("*.py") if "addition" in p.read_text() or "tasks" in p.read_text()]
    assert named == [], f"train/ mentions the embedded task: {named}"


def _module_graph() -> dict[str, set[str]]:
    """module → the package's modules it imports (function-level imports too); packages' `__init__` re-exports are
    left out, a cycle through them being only a name passed on."""
    modules = {
        ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts): path
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    }
    return {
        module: {imported for _, imported in _imports(path, module) if imported in modules and imported != module}
        for module, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each import cycle of `graph` once, as the modules along it."""
    found, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :]
            if frozenset(cycle) not in done:
                done.add(frozenset(cycle))
                found.append([*cycle, module])
            return
        for imported in sorted(graph[module]):
            visit(imported, [*path, module])

    for module in sorted(graph):
        visit(module, [])
    return found


def test_no_two_modules_import_each_other() -> None:
    """An import cycle between modules (one side often a function-level import) means two modules share one job or
    a fact sits in the wrong one; the fact moves below both."""
    assert _cycles(_module_graph()) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_neither_the_package_nor_the_benchmarks_import_the_tests() -> None:
    """The tests use the package and the benchmarks (`make bench`, `make gpu-check`), never the other way: a bench
    that needs a helper of the tests' has it moved into bench/ (as `bench.ports` and `bench.tiny` were)."""
    repo = PACKAGE.parent
    importers = sorted(
        f"{path.relative_to(repo)}:{line}"
        for folder in (PACKAGE, repo / "bench")
        for path in folder.rglob("*.py")
        for line, module in _imports(path, ".".join(path.relative_to(repo).with_suffix("").parts))
        if module.split(".")[0] == "tests"
    )
    assert importers == [], f"these import the tests: {importers}"
