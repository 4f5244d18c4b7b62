"""Third-party modules that Megatron-Core imports with its own but a run may never use, executed at their first use.

`megatron.core.timers` imports `wandb` at import time (to recognise a W&B writer in `Timers.write`): 0.54 of the
~4.4 CPU-seconds every process importing the trainer paid (`python -X importtime`, 2 cores) — W&B's settings,
service client and pydantic models — though only a run with `trainer.logger: [..., wandb]` ever calls it.

`install()` (run by `import megatron_ppo`, before this package imports Megatron) binds each module of `LAZY` in
`sys.modules` as the module object the import system would make (`importlib.util.module_from_spec`: its `__name__`,
`__file__`, `__spec__`, `__loader__`), not yet executed. Reading any attribute it does not have yet — anything of the
module's own, or `__path__` (a submodule's import asks for it) — executes the module into that same object first,
so every holder of it (Megatron's `timers.wandb`) sees the real module from then on. The standard library's
`importlib.util.LazyLoader` would execute it on any attribute, `__file__` included, which `inspect.getmodule` reads
of every module in `sys.modules` whenever torch registers an operator while Megatron imports. A module that is not
installed stays absent (its `import` raises as before); one already imported is left as it is."""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from typing import Any

LAZY = ("wandb",)
_LOCK = threading.RLock()
_EXECUTING: set[str] = set()  # the modules being executed (by the thread holding `_LOCK`)


class _NotExecuted(types.ModuleType):
    """A module bound but not executed: the first read of an attribute it lacks executes it, in place; the other
    threads wait for that, and the executing one, reading what its module has not set yet, gets the AttributeError
    of a partially initialised module."""

    def __getattr__(self, name: str) -> Any:
        with _LOCK:
            if type(self) is _NotExecuted and self.__name__ not in _EXECUTING:
                _EXECUTING.add(self.__name__)
                try:
                    spec = self.__spec__
                    if spec.submodule_search_locations is not None:
                        self.__path__ = spec.submodule_search_locations
                    spec.loader.exec_module(self)
                    self.__class__ = types.ModuleType
                finally:
                    _EXECUTING.discard(self.__name__)
        if type(self) is _NotExecuted:
            raise AttributeError(f"partially initialized module {self.__name__!r} has no attribute {name!r}")
        return getattr(self, name)


def install() -> None:
    """Each module of `LAZY` that is installed and not yet imported: bound in `sys.modules`, executed at first use."""
    for name in LAZY:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            continue
        module = importlib.util.module_from_spec(spec)
        module.__dict__.pop("__path__", None)  # so that importing a submodule executes the package first
        module.__class__ = _NotExecuted
        sys.modules[name] = module
