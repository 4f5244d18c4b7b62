"""Megatron-Core's `torch.compile` decorations, compiled at their first call as always, but set up then too.

Megatron-Core decorates functions with `torch.compile` as its modules are imported: the fused activations and
biases through `megatron.core.jit.jit_fuser` (`= torch.compile` on torch ≥ 2.2) and the MoE router's top-k. Nothing
is compiled there (`torch.compile` compiles at a function's first call), but each decoration imports torch's
compiler stack (dynamo, inductor's `compile_fx` and its kernel templates): 1.4 CPU-seconds of every process that
imports `megatron.core` (measured on 2 cores: `import megatron_ppo.train.run` 7.0–7.3 → 5.6–5.9 CPU-s), whether or
not it ever calls one of them — validation-only, conversion and CPU runs never do.

`install()` (run by `import megatron_ppo`, before this package imports Megatron) makes `torch.compile` of a plain
function defined in a `megatron.` module return a wrapper that calls `torch.compile` on the function at its first call
and the compiled function from then on: the same compilation at the same moment, with the same options; called
inside a function being compiled, it is traced through to the original, as dynamo does with a compiled one. Anything
else (modules, other packages' functions, decorations made before `install`) goes to `torch.compile` unchanged."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

TORCH_COMPILE = torch.compile  # torch's own, as imported before `install`


def compile_megatron_on_first_call(model: Callable | None = None, **options: Any) -> Any:
    """`torch.compile(model, **options)`, deferred to `model`'s first call when it is a function of Megatron's."""
    if model is None:  # `@torch.compile(...)`: the decorator
        return lambda function: compile_megatron_on_first_call(function, **options)
    if not (inspect.isfunction(model) and model.__module__.startswith("megatron.")):
        return TORCH_COMPILE(model, **options)
    compiled: Callable | None = None

    @functools.wraps(model)
    def compiled_at_first_call(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # called by a function being compiled: traced inline, as dynamo inlines a
            return model(*args, **kwargs)  # compiled function it meets (bias_swiglu's call of swiglu)
        nonlocal compiled
        if compiled is None:
            compiled = TORCH_COMPILE(model, **options)
        return compiled(*args, **kwargs)

    return compiled_at_first_call


def install() -> None:
    """Route `torch.compile` through `compile_megatron_on_first_call` (once per process)."""
    torch.compile = compile_megatron_on_first_call  # type: ignore[assignment]
