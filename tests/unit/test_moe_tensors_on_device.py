"""Every tensor `models/moe.py` makes names its device: they are all-reduced over the expert-parallel group, and
NCCL refuses host tensors (the CPU suite's gloo takes either, so only the source can show it)."""

from __future__ import annotations

import ast
from pathlib import Path

from megatron_ppo.models import moe

FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "as_tensor"}


def test_every_torch_factory_call_in_moe_names_a_device() -> None:
    tree = ast.parse(Path(moe.__file__).read_text())
    hostless = [
        f"line {node.lineno}: torch.{node.func.attr}(...)"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and node.func.attr in FACTORIES
        and not any(keyword.arg == "device" for keyword in node.keywords)
    ]
    assert not hostless, f"tensors made on the host in models/moe.py (pass device=...): {hostless}"
