"""Every config key is read by code: a key that nothing reads promises what the trainer does not do.

A leaf counts as read where the package outside `config/` (or `slurm/`, or `config/layout.py`, the layout arithmetic
the trainer and the planner compute with, not a validation) reads it as an attribute of a config object
of its own section class — `trainer.save_freq`, `mg.sequence_parallel` after `mg = config.actor.megatron` or with
`mg: MegatronConfig`, `stage.end` in `for stage in kl_ctrl.stages`, `self.config.max_consecutive_skips` after
`self.config = config` with `config: GuardsConfig` — or names it as a string (`getattr(c, "x")`, a dotted key
`"actor.ppo_epochs"`, the keys `attrgetter` reads). A `.name` on anything else (a file's, a module's) does not count.
A key read where this cannot see is listed below with the reason.
"""

from __future__ import annotations

import ast
import dataclasses
import typing
from collections.abc import Iterator
from pathlib import Path

from megatron_ppo.config.schema import PPOConfig

REPO = Path(__file__).resolve().parents[2]
READ_ELSEWHERE = {
    "actor.clip_ratio": "the default of clip_ratio_low/high, filled in by config.validate.resolve",
    "critic.lora.merge": "refused unless false (config/lora_rules.py): `convert mcore-to-hf` exports the actor only",
}


def _schema(root: type) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(field name → the section classes it holds, section class → its leaf names) over the whole schema; a list
    of sections (`kl_ctrl.stages`, `guards.watch`) holds its element's class."""
    holds: dict[str, set[str]] = {}
    leaves: dict[str, set[str]] = {}
    todo, seen = [root], set()
    while todo:
        section = todo.pop()
        if section in seen:
            continue
        seen.add(section)
        hints = typing.get_type_hints(section)
        for field in dataclasses.fields(section):
            held = [t for t in (hints[field.name], *typing.get_args(hints[field.name])) if dataclasses.is_dataclass(t)]
            for inner in held:
                holds.setdefault(field.name, set()).add(inner.__name__)
                todo.append(inner)
            if not held or typing.get_origin(hints[field.name]) is list:  # a list of sections is a key too
                leaves.setdefault(section.__name__, set()).add(field.name)
    return holds, leaves


HOLDS, LEAVES = _schema(PPOConfig)
SECTIONS = {*LEAVES, PPOConfig.__name__}
ROLE_SECTIONS = {"ActorConfig", "RefConfig", "CriticConfig"}  # getattr(config, role)


class _ConfigReads(ast.NodeVisitor):
    """The (section class, leaf) pairs one module reads as attributes of config objects: each expression's section
    classes inferred from the field it names, a local variable assigned from one, a parameter's annotation, a loop
    over a list of sections, or an attribute of `self` set from one in the same class."""

    def __init__(self, tree: ast.Module) -> None:
        self.reads: set[tuple[str, str]] = set()
        functions = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]
        self.returns = {node.name: self.annotated(node.returns) for node in functions if self.annotated(node.returns)}
        self.scopes: list[dict[str, set[str]]] = [{}]
        self.self_attributes: list[dict[str, set[str]]] = [{}]

    def sections_of(self, node: ast.expr) -> set[str]:
        if isinstance(node, ast.IfExp):  # config.critic if critic else config.actor
            return self.sections_of(node.body) | self.sections_of(node.orelse)
        if isinstance(node, ast.Name):
            return next(
                (scope[node.id] for scope in reversed(self.scopes) if node.id in scope), HOLDS.get(node.id, set())
            )
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in self.self_attributes[-1]:
                return self.self_attributes[-1][node.attr]
            return HOLDS.get(node.attr, set())
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
            called = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if called in self.returns:  # a function of this module annotated to return a section
                return self.returns[called]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            key = node.args[1] if len(node.args) > 1 else None
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                return HOLDS.get(key.value, set())
            return ROLE_SECTIONS if "PPOConfig" in self.sections_of(node.args[0]) else set()
        return set()

    @staticmethod
    def annotated(annotation: ast.expr | None) -> set[str]:
        if annotation is None:
            return set()
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            return set(annotation.value.replace("|", " ").split()) & SECTIONS
        return {n.id for n in ast.walk(annotation) if isinstance(n, ast.Name)} & SECTIONS

    def _bind(self, target: ast.expr, sections: set[str]) -> None:
        if not sections:
            return
        if isinstance(target, ast.Name):
            self.scopes[-1][target.id] = sections
        elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
            self.self_attributes[-1][target.attr] = sections

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.self_attributes.append({})
        for _ in range(2):  # a first pass learns what `self.x` holds, wherever in the class it is set
            self.generic_visit(node)
        self.self_attributes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        arguments = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        self.scopes.append({a.arg: self.annotated(a.annotation) for a in arguments if self.annotated(a.annotation)})
        self.generic_visit(node)
        self.scopes.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._bind(target, self.sections_of(node.value))
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        value = self.sections_of(node.value) if node.value is not None else set()
        self._bind(node.target, self.annotated(node.annotation) or value)
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self._bind(node.target, self.sections_of(node.iter))
        self.generic_visit(node)

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind(node.target, self.sections_of(node.iter))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        for section in self.sections_of(node.value):
            if node.attr in LEAVES.get(section, ()):
                self.reads.add((section, node.attr))
        self.generic_visit(node)


def _leaves(schema: type, prefix: str = "") -> Iterator[tuple[str, str, str]]:
    """(dotted key, section class, leaf name) of every non-section field."""
    for field in dataclasses.fields(schema):
        section = field.default_factory() if field.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(section):
            yield from _leaves(type(section), f"{prefix}{field.name}.")
        else:
            yield f"{prefix}{field.name}", schema.__name__, field.name


def _sources() -> list[Path]:
    package = [p for p in (REPO / "megatron_ppo").rglob("*.py") if "config" not in p.relative_to(REPO).parts]
    return [*package, REPO / "megatron_ppo" / "config" / "layout.py", *sorted((REPO / "slurm").glob("*.py"))]


def _named(tree: ast.Module) -> set[str]:
    """What a module names as strings: dotted keys (`"actor.ppo_epochs"`, `".ppo_max_token_len_per_gpu"`, as
    `attrgetter` reads them) and `getattr`'s attribute names."""
    strings = [n.value.lstrip(".") for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    dotted = {s for s in strings if "." in s and all(part.isidentifier() for part in s.split("."))}
    getattr_names = {call.args[1].value for call in ast.walk(tree)
                     if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "getattr"
                     and len(call.args) > 1 and isinstance(call.args[1], ast.Constant)}  # fmt: skip
    return dotted | {str(name) for name in getattr_names}


def _unread(sources: list[Path]) -> list[str]:
    reads: set[tuple[str, str]] = set()
    named: set[str] = set()
    for path in sources:
        tree = ast.parse(path.read_text())
        visitor = _ConfigReads(tree)
        visitor.visit(tree)
        reads |= visitor.reads
        named |= _named(tree)

    def by_name(key: str, leaf: str) -> bool:
        return leaf in named or any(f".{key}".endswith(f".{string}") for string in named if "." in string)

    return [key for key, section, leaf in _leaves(PPOConfig)
            if key not in READ_ELSEWHERE and (section, leaf) not in reads and not by_name(key, leaf)]  # fmt: skip


def test_every_config_key_is_read_by_code() -> None:
    assert _unread(_sources()) == [], "read these keys, refuse them in config/validate.py, or remove them"


def test_the_walk_reaches_nested_sections() -> None:
    keys = {key for key, _, _ in _leaves(PPOConfig)}
    assert {"actor.megatron.tensor_model_parallel_size", "algorithm.kl_ctrl.stage_unit", "data.addition.sft_lr"} <= keys


def test_an_attribute_of_something_else_is_not_a_read(tmp_path: Path) -> None:
    """`path.name` or `args.seed` do not read `model.name` or `trainer.seed`; `config.model.name` does."""
    source = tmp_path / "reads.py"
    source.write_text("def f(path, args):\n    return path.name, args.seed\n")
    assert {"model.name", "trainer.seed"} <= set(_unread([source]))
    body = "    t = config.trainer\n    return config.model.name, t.seed, mg.sequence_parallel\n"
    source.write_text(f"def f(config, mg: MegatronConfig):\n{body}")
    unread = set(_unread([source]))
    assert not {"model.name", "trainer.seed", "actor.megatron.sequence_parallel"} & unread
