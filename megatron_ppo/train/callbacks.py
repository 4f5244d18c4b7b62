"""Callbacks that do not keep their owner alive.

The trainer hands its parts (host offload, the profiler, the checkpoint keeper) callbacks that report through the
trainer, and the optimizer is handed to Megatron's schedule through the model's `TransformerConfig`
(`grad_scale_func`, `no_sync_func`). A bound method or a closure over `self` stored in something its owner holds is
a reference cycle: the owner — a trainer with three models and their optimizer states — is then freed only when the
cycle collector next runs, not when the last reference goes. `weak_callback` keeps a weak reference instead, so
dropping the owner frees it at once.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any


def weak_callback(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` (bound) without a strong reference to its object; calling it after the object is gone raises."""
    reference = weakref.WeakMethod(method)  # type: ignore[arg-type]
    name = getattr(method, "__qualname__", repr(method))

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = reference()
        if bound is None:
            raise ReferenceError(f"{name} was called after its object was freed")
        return bound(*args, **kwargs)

    call.__qualname__ = f"weak_callback({name})"
    return call
