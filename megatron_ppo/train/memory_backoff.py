"""Out-of-memory back-off: when a phase of an iteration runs out of device memory on any rank, every rank frees what it
can and runs the phase again with smaller micro-batches — one row fewer, or a token budget 1/8 smaller with dynamic
batching — at most `guards.max_oom_retries` times in a run. The smaller sizes are the back-off's own state (the config
stays as validated): the passes ask it for their micro-batching (`micro_batching`), and the checkpoint keeps it so a
resumed run starts with them.

The ranks agree through one all-reduce after the phase, so recovery works when every rank that raised reaches it:
an out-of-memory error on one rank in the middle of a collective leaves the others waiting in that collective, and
no framework recovers from that without a timeout.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

import torch

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.parallel.collectives import any_rank
from megatron_ppo.parallel.ranks import data_parallel
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.micro_batching import TOKEN_BUDGET, MicroBatching, micro_batch_keys, micro_batching

T = TypeVar("T")
TOKEN_BUDGET_SHRINK = 7 / 8


class OutOfMemoryBackoff:
    """Runs phases with retries on `torch.OutOfMemoryError`; `overrides` are the micro-batch sizes it has lowered,
    by config key (dotted), in place of the config's values."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.retries = 0
        self.overrides: dict[str, int] = {}

    def micro_batching(self, phase: Phase) -> dict[str, MicroBatching]:
        """role → its micro-batching in `phase`, as lowered so far."""
        return micro_batching(self.config, phase, self.overrides)

    def size(self, key: str) -> int | None:
        """The micro-batch size (or token budget) `key` stands for now: the lowered one, else the config's."""
        return self.overrides.get(key, attrgetter(key)(self.config))

    def run(self, phase: Phase, attempt: Callable[[], T], free: Callable[[], None], log: Callable[[str], None]) -> T:
        """`attempt()` until no rank runs out of memory; after a failure, `free()` and lower the micro-batch sizes
        of `phase` (`micro_batch_keys`: a micro-batch size, or a token budget when the role batches by tokens), which
        `attempt` reads from `micro_batching(phase)`."""
        while True:
            error = None
            try:
                result = attempt()
            except torch.OutOfMemoryError as caught:
                error = caught
            if not any_rank(error is not None):
                return result
            del error
            free()
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self.retries += 1
            limit = self.config.guards.max_oom_retries
            keys = list(dict.fromkeys(micro_batch_keys(self.config, phase).values()))
            if self.retries > limit:
                raise RuntimeError(f"{phase}: out of memory again after {limit} retries (guards.max_oom_retries); "
                                   f"lower {', '.join(keys)} or spread the model wider (TP/PP)")  # fmt: skip
            log(f"{phase}: out of memory on some rank; retry {self.retries}/{limit} with " + self._shrink(phase, keys))

    def _shrink(self, phase: Phase, keys: list[str]) -> str:
        changes = []
        for key in keys:
            current = self.size(key)
            if key.endswith(TOKEN_BUDGET):
                smaller = int(current * TOKEN_BUDGET_SHRINK)
            else:
                smaller = (current if current is not None else self._whole_share(key)) - 1
            if smaller < 1:
                raise RuntimeError(f"{phase}: out of memory with {key}={current}: not even one row fits; shorten "
                                   "data.max_prompt_length / data.max_response_length or spread the model wider "
                                   "(tensor/pipeline parallel)")  # fmt: skip
            self.overrides[key] = smaller
            changes.append(f"{key}={smaller}")
        return ", ".join(changes)

    def _whole_share(self, key: str) -> int:
        """The rows one replica runs at once when its micro-batch size is unset: its share of the mini-batch (an
        update) or of the whole batch (an experience pass)."""
        section, name = key.rsplit(".", 1)
        if name == "ppo_micro_batch_size_per_gpu":
            rows = attrgetter(section)(self.config).ppo_mini_batch_size
        else:
            rows = self.config.data.train_batch_size
        return max(1, rows // data_parallel().size)

    def state_dict(self) -> dict[str, Any]:
        return {"retries": self.retries, "overrides": dict(self.overrides)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.retries, self.overrides = state["retries"], dict(state["overrides"])
