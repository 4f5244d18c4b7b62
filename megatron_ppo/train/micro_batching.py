"""Which config key sizes each role's micro-batches in each phase of an iteration, and the sizes they give: rows per
micro-batch, or a token budget with dynamic batching (`use_dynamic_bsz`). The out-of-memory back-off lowers them
(`memory_backoff.py`) without touching the config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.planner.phases import Phase

TOKEN_BUDGET = ".ppo_max_token_len_per_gpu"  # the key ending of a role's token budget (dynamic batching)


@dataclass(frozen=True)
class MicroBatching:
    """How one role's pass cuts its rows: micro-batches of `rows` rows (None: this replica's whole share at once),
    or, with `max_tokens` (dynamic batching), of at most that many tokens."""

    rows: int | None = None
    max_tokens: int | None = None


def micro_batch_keys(config: PPOConfig, phase: Phase) -> dict[str, str]:
    """role → the config key that sizes its micro-batches in `phase` (the experience or an update), which an
    out-of-memory error there lowers: the role's micro-batch size of that pass, or its token budget with
    `use_dynamic_bsz` (the reference's forward follows the actor's batching)."""
    if phase == Phase.EXPERIENCE:
        keys = {"actor": "actor.log_prob_micro_batch_size_per_gpu"}
        if config.needs_reference:
            keys["ref"] = "ref.log_prob_micro_batch_size_per_gpu"
        if config.needs_critic:
            keys["critic"] = "critic.forward_micro_batch_size_per_gpu"
    elif (role := phase.trained_role) is not None:
        keys = {role: f"{role}.ppo_micro_batch_size_per_gpu"}
    else:
        raise ValueError(f"{phase!r} runs no model: no micro-batches")
    owner = {"actor": "actor", "ref": "actor", "critic": "critic"}
    return {
        role: f"{owner[role]}{TOKEN_BUDGET}" if getattr(config, owner[role]).use_dynamic_bsz else key
        for role, key in keys.items()
    }


def micro_batching(
    config: PPOConfig, phase: Phase, lowered: Mapping[str, int] | None = None
) -> dict[str, MicroBatching]:
    """role → its micro-batching in `phase`: the config's sizes (`micro_batch_keys`), or those `lowered` gives by
    key (the back-off's)."""
    out = {}
    for role, key in micro_batch_keys(config, phase).items():
        size = (lowered or {}).get(key, attrgetter(key)(config))
        out[role] = MicroBatching(max_tokens=size) if key.endswith(TOKEN_BUDGET) else MicroBatching(rows=size)
    return out
