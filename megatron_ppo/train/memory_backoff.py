"""Out-of-memory back-off: when a phase of an iteration runs out of device memory on any rank, every rank frees what it
can and runs the phase again with smaller micro-batches — one row fewer, or a token budget 1/8 smaller with dynamic
batching — at most `guards.max_oom_retries` times in a run. The smaller sizes are config values from then on, kept in
the checkpoint so a resumed run starts with them.

The ranks agree through one all-reduce after the phase, so recovery works when every rank that raised reaches it:
an out-of-memory error on one rank in the middle of a collective leaves the others waiting in that collective, and
no framework recovers from that without a timeout.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from megatron.core import parallel_state

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.parallel.collectives import any_rank

T = TypeVar("T")
TOKEN_BUDGET_SHRINK = 7 / 8


class OutOfMemoryBackoff:
    """Runs phases with retries on `torch.OutOfMemoryError`; `overrides` are the config keys it has lowered."""

    def __init__(self, config: PPOConfig) -> None:
        self.config = config
        self.retries = 0
        self.overrides: dict[str, int] = {}

    def run(self, phase: str, keys: list[str], attempt: Callable[[], T], free: Callable[[], None],
            log: Callable[[str], None]) -> T:  # fmt: skip
        """`attempt()` until no rank runs out of memory; after a failure, `free()` and lower the micro-batch `keys`
        (dotted config paths: a micro-batch size, or a token budget when the role batches by tokens)."""
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
            if self.retries > limit:
                raise RuntimeError(f"{phase}: out of memory again after {limit} retries (guards.max_oom_retries); "
                                   f"lower {', '.join(keys)} or spread the model wider (TP/PP)")  # fmt: skip
            log(f"{phase}: out of memory on some rank; retry {self.retries}/{limit} with " + self._shrink(phase, keys))

    def _shrink(self, phase: str, keys: list[str]) -> str:
        changes = []
        for key in keys:
            section, name = key.rsplit(".", 1)
            holder = _get(self.config, section)
            current = getattr(holder, name)
            if name == "ppo_max_token_len_per_gpu":
                smaller = int(current * TOKEN_BUDGET_SHRINK)
            else:
                smaller = (current if current is not None else self._whole_share(section, name)) - 1
            if smaller < 1:
                raise RuntimeError(f"{phase}: out of memory with {key}={current}: not even one row fits; shorten "
                                   "data.max_prompt_length / data.max_response_length or spread the model wider "
                                   "(tensor/pipeline parallel)")  # fmt: skip
            setattr(holder, name, smaller)
            self.overrides[key] = smaller
            changes.append(f"{key}={smaller}")
        return ", ".join(changes)

    def _whole_share(self, section: str, name: str) -> int:
        """The rows one replica runs at once when its micro-batch size is unset: its share of the mini-batch (an
        update) or of the whole batch (an experience pass)."""
        if name == "ppo_micro_batch_size_per_gpu":
            rows = _get(self.config, section).ppo_mini_batch_size
        else:
            rows = self.config.data.train_batch_size
        return max(1, rows // parallel_state.get_data_parallel_world_size())

    def state_dict(self) -> dict[str, Any]:
        return {"retries": self.retries, "overrides": dict(self.overrides)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.retries, self.overrides = state["retries"], dict(state["overrides"])
        for key, value in self.overrides.items():
            section, name = key.rsplit(".", 1)
            setattr(_get(self.config, section), name, value)


def _get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def micro_batch_keys(config: PPOConfig, phase: str) -> list[str]:
    """The config keys an out-of-memory error in `phase` ("experience", "update_actor", "update_critic") lowers."""
    if phase == "experience":
        roles = ["actor"] + (["ref"] if config.actor.use_kl_loss or config.algorithm.use_kl_in_reward else [])
        keys = [f"{r}.log_prob_micro_batch_size_per_gpu" for r in roles]
        if config.algorithm.adv_estimator == "gae":
            keys.append("critic.forward_micro_batch_size_per_gpu")
        dynamic = {"actor": config.actor.use_dynamic_bsz, "ref": config.actor.use_dynamic_bsz,
                   "critic": config.critic.use_dynamic_bsz}  # fmt: skip
        budget = {"actor": "actor.ppo_max_token_len_per_gpu", "ref": "actor.ppo_max_token_len_per_gpu",
                  "critic": "critic.ppo_max_token_len_per_gpu"}  # fmt: skip
        return list(dict.fromkeys(budget[k.split(".")[0]] if dynamic[k.split(".")[0]] else k for k in keys))
    role = phase.removeprefix("update_")
    role_config = getattr(config, role)
    name = "ppo_max_token_len_per_gpu" if role_config.use_dynamic_bsz else "ppo_micro_batch_size_per_gpu"
    return [f"{role}.{name}"]
