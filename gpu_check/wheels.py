"""What `make gpu-check` needs on a bare CUDA machine (Python 3.12 and PyTorch, nothing else, no network), derived from
the code rather than written down: the third-party modules that the check and the command line it launches import
when their modules load (module-level imports of every own module they reach; those inside a function or a `try` are
optional: wandb, matplotlib, Transformer Engine), the distributions that provide them here, everything those require
(their metadata, markers evaluated, no extras), less what PyTorch itself requires (the machine has it), at the
versions of `requirements/lock.txt`.

    python -m gpu_check.wheels            # the `name==version` list `make gpu-wheels` (gpu_check/wheels.sh) fetches
    python -m gpu_check.wheels --target gpu_check/targets/nvidia-h200.txt   # only what that machine lacks
    python -m gpu_check.wheels --check    # on the GPU machine: exit 1 naming each module that does not import

`--check` needs nothing but the source tree and the standard library (`make gpu-check` runs it before the check)."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what `make gpu-check` runs: the check (every part, bench.ports and bench.tiny included) and the CLI that its parts
# (a) and (h) launch
ENTRIES = ("gpu_check.__main__", "megatron_ppo.__main__")
OWN = frozenset({"megatron_ppo", "bench", "gpu_check"})
LOCK = REPO / "requirements" / "lock.txt"
PRESENT = "torch"  # the one distribution a bare GPU machine has, with its own requirements


def _own_file(root: Path, module: str) -> Path | None:
    path = root / Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(tree: ast.Module) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported anywhere), leaving out `try` blocks (optional imports)
    and `if TYPE_CHECKING:` blocks; `from a import b` counts `a` and `a.b` (b may be a submodule)."""
    top: set[str] = set()
    anywhere: set[str] = set()

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, ast.Try | ast.TryStar):
            return
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        names: set[str] = set()
        if isinstance(node, ast.Import):
            names = {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        (top if module_level else anywhere).update(names)
        anywhere.update(names)
        inner = module_level and not isinstance(
            node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda
        )
        for child in ast.iter_child_nodes(node):
            visit(child, inner or (module_level and isinstance(node, ast.ClassDef)))

    for statement in tree.body:
        visit(statement, True)
    return top, anywhere


def load_time_imports(root: Path = REPO, entries: tuple[str, ...] = ENTRIES) -> set[str]:
    """The top-level names of the third-party modules that the own modules reachable from `entries` import when
    they load (module level: what a function imports, or a `try`, is optional — wandb, matplotlib, verl's rewards,
    Transformer Engine). Own modules are followed through every import, a function's too (the CLI imports the
    command it runs), with their parent packages."""
    seen: set[str] = set()
    third_party: set[str] = set()
    queue = list(entries)
    while queue:
        module = queue.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        queue += [".".join(parts[:i]) for i in range(1, len(parts))]  # importing a.b.c runs a and a.b first
        path = _own_file(root, module)
        if path is None:
            continue
        top, anywhere = _imports(ast.parse(path.read_text(), str(path)))
        queue += [name for name in anywhere if name.split(".")[0] in OWN]
        third_party |= {name.split(".")[0] for name in top if name.split(".")[0] not in OWN}
    return {name for name in third_party if name not in sys.stdlib_module_names and name != "__future__"}


def missing_modules(names: set[str]) -> list[str]:
    """The names among `names` that no installed module answers (without importing them)."""
    return sorted(name for name in names if importlib.util.find_spec(name) is None)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_closure(roots: set[str]) -> set[str]:
    """`roots` and every distribution they require here, transitively (markers evaluated, no extras)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    seen: set[str] = set()
    queue = [_canonical(name) for name in roots]
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                queue.append(_canonical(requirement.name))
    return seen


def _lock_pins() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split(";")[0].strip().split("==")
            pins[_canonical(name)] = version
    return pins


def read_freeze(path: Path) -> dict[str, str]:
    """`pip list --format=freeze` (or `pip freeze`) of the target machine: canonical name → version."""
    out = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.strip().split("==", 1)
            out[_canonical(name)] = version
    return out


def _missing_on(target: dict[str, str], roots: dict[str, str]) -> set[str]:
    """The distributions the target lacks: each root (name → the range this package declares for it) that the
    target has at no version in its range, and, of each one it lacks, the requirements it lacks in turn (a
    distribution the target has in range brings its own requirements)."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    missing: set[str] = set()
    queue = [(name, SpecifierSet(spec)) for name, spec in roots.items()]
    while queue:
        name, specifier = queue.pop()
        have = target.get(name)
        if name in missing or (have is not None and specifier.contains(have, prereleases=True)):
            continue
        missing.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                queue.append((_canonical(requirement.name), requirement.specifier))
    return missing


def wheel_list(root: Path = REPO, target: dict[str, str] | None = None) -> list[str]:
    """`name==version` (the lock's) of every distribution that `load_time_imports` needs and the target lacks:
    without `target` (a freeze of the machine, `read_freeze`), a bare Python + PyTorch machine (everything but what
    PyTorch requires); with it, what the target has at no version in the range this package declares (or that a
    missing distribution requires). Raises naming a distribution the lock does not pin."""
    from importlib import metadata

    from packaging.requirements import Requirement

    providers = metadata.packages_distributions()
    unknown = sorted(name for name in load_time_imports(root) if name not in providers)
    if unknown:
        raise RuntimeError(f"no installed distribution provides {unknown}: install the package (make setup) first")
    imported = {_canonical(dist) for name in load_time_imports(root) for dist in providers[name]}
    if target is None:
        needed = _requirement_closure(imported) - _requirement_closure({PRESENT})
    else:
        declared = {_canonical(Requirement(line).name): str(Requirement(line).specifier)
                    for line in metadata.requires("megatron-ppo") or [] if "extra ==" not in line}  # fmt: skip
        needed = _missing_on(target, {name: declared.get(name, "") for name in imported})
    pins = _lock_pins()
    unpinned = sorted(needed - pins.keys())
    if unpinned:
        raise RuntimeError(f"{LOCK} pins no version of {unpinned}: regenerate it (make lock)")
    return sorted(f"{name}=={pins[name]}" for name in needed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="name the load-time imports that are missing here")
    parser.add_argument("--target", type=Path, help="the target machine's `pip list --format=freeze`: only what it "
                        "lacks (gpu_check/targets/ holds the lent GPU machine's)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.check:
        missing = missing_modules(load_time_imports())
        if missing:
            print(f"error: the GPU check cannot start: no module {', '.join(missing)} on {sys.executable}; run "
                  "`make gpu-wheels` where there is network, carry .whl/ here and rerun `make gpu-check` (it installs "
                  "them into .whl/site)", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    print("\n".join(wheel_list(target=read_freeze(args.target) if args.target else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
