"""Out-of-memory back-off: when a step of a phase runs out of device memory on any rank, every rank frees what it
can and runs that step again with smaller micro-batches — one row fewer, or a token budget 1/8 smaller with dynamic
batching — at most `guards.max_oom_retries` times in a run. The smaller sizes are the back-off's own state (the config
stays as validated): the passes ask it for their micro-batching (`micro_batching`), and the checkpoint keeps it so a
resumed run starts with them.

What is retried is what failed and nothing applied: an update retries one mini-batch's forward-backward (its
gradients zeroed first, `train/update.py`), before that mini-batch's optimizer step, so the steps already taken stay
taken once and the learning-rate schedule advances once per mini-batch; an experience pass (no weights change)
retries whole. Restoring the weights and optimizer states a phase started from would need a copy of them, exactly
when memory is short.

The ranks agree after each step with two flags all-reduced on a host (gloo) group with a timeout
(`guards.oom_agreement_timeout_s`; no device synchronisation): some rank ran out of memory, every rank did. Every
rank, at the same point (equal shards and shapes: they run out together): they retry together. Some ranks only: the
others have issued collectives of the device groups (a tensor-parallel all-reduce in a forward, the data-parallel
gradient reduce) that the failed ranks never will, and either wait inside one (gloo, or NCCL where the host waits
on the device) and never reach the agreement, or reach it (NCCL enqueues collectives without waiting) with their
communicators out of step. Nothing brings a communicator back into step without aborting it: Megatron-LM and NeMo-RL
do not try (the NCCL watchdog's timeout aborts the job; torchelastic or the scheduler restarts it from the last
checkpoint), and neither does this module, but it does not wait for the watchdog: once the ranks disagree (or the
agreement times out) it logs one line — the phase, the sizes to lower, the checkpoint `latest` names — and leaves
the process at once with `OUT_OF_MEMORY_STOP_EXIT` (torchrun then stops the ranks still in a collective). The
checkpoint is left as it was, and the run resumes from it. Not detected: every rank out of memory, but at
different micro-batches (their device collectives then differ in number too).
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar

import torch

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.parallel.collectives import any_and_every_rank_within, global_rank, host_group
from megatron_ppo.parallel.ranks import data_parallel
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.guards import GUARD_STOP_EXIT
from megatron_ppo.train.micro_batching import TOKEN_BUDGET, MicroBatching, micro_batch_keys, micro_batching

T = TypeVar("T")
TOKEN_BUDGET_SHRINK = 7 / 8
OUT_OF_MEMORY_STOP_EXIT = GUARD_STOP_EXIT  # a guard's stop: the next job of a chain must not start unchanged


class OutOfMemoryBackoff:
    """Runs phases with retries on `torch.OutOfMemoryError`; `overrides` are the micro-batch sizes it has lowered,
    by config key (dotted), in place of the config's values."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.retries = 0
        self.overrides: dict[str, int] = {}
        self.group = host_group(config.guards.oom_agreement_timeout_s)  # collective: every rank builds a back-off

    def micro_batching(self, phase: Phase) -> dict[str, MicroBatching]:
        """role → its micro-batching in `phase`, as lowered so far."""
        return micro_batching(self.config, phase, self.overrides)

    def size(self, key: str) -> int | None:
        """The micro-batch size (or token budget) `key` stands for now: the lowered one, else the config's."""
        return self.overrides.get(key, attrgetter(key)(self.config))

    def run(self, phase: Phase, attempt: Callable[[], T], free: Callable[[], None], log: Callable[[str], None]) -> T:
        """`attempt()` until no rank runs out of memory; after a failure, `free()` and lower the micro-batch sizes
        of `phase` (`micro_batch_keys`: a micro-batch size, or a token budget when the role batches by tokens), which
        `attempt` reads from `micro_batching(phase)`. `attempt` must leave nothing applied when it raises (no
        optimizer step inside it). When the ranks cannot agree (one ran out of memory alone: module docstring),
        the process ends here with `OUT_OF_MEMORY_STOP_EXIT` after `log`ging why."""
        while True:
            error = None
            try:
                result = attempt()
            except torch.OutOfMemoryError as caught:
                error = caught
            agreed = any_and_every_rank_within(error is not None, self.group)
            if agreed is None or agreed[0] != agreed[1]:  # timed out, or some ranks only
                self._stop(phase, agreed is None, log)
            if not agreed[0]:
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

    def _stop(self, phase: Phase, timed_out: bool, log: Callable[[str], None]) -> None:
        """One line on stderr (and `log`: the run's event log) naming what happened, what to lower and the
        checkpoint left — from the rank that timed out, or rank 0 when every rank knows — then the process ends
        without unwinding: device collectives are out of step, and a normal exit would wait in them (process-group
        teardown, a pending checkpoint finalisation)."""
        keys = ", ".join(dict.fromkeys(micro_batch_keys(self.config, phase).values()))
        latest = Path(self.config.trainer.default_local_dir) / "latest"
        left = f"{latest.read_text().strip()} ({latest} names it)" if latest.is_file() else "none yet"
        why = (f"not every rank reached the agreement within {self.config.guards.oom_agreement_timeout_s:g} s "
               "(guards.oom_agreement_timeout_s)" if timed_out else "not on every rank")  # fmt: skip
        message = (f"{phase}: out of memory on some ranks only ({why}): the others are in a collective the failed "
                   f"ranks will not issue; stopping. Checkpoint left: {left}. Lower {keys} (or spread the model "
                   f"wider) and resume; exit {OUT_OF_MEMORY_STOP_EXIT}")  # fmt: skip
        if timed_out or global_rank() == 0:
            log(message)
            print(f"stopped: {message}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(OUT_OF_MEMORY_STOP_EXIT)

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
