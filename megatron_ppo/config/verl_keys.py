"""verl's command-line keys on our config: renamed paths, keys whose value sets several of ours, and refusals.

A verl launch script's overrides are read as verl means them (docs/reference/verl-keys.md lists each one):
  - `VERL_ALIASES`: a verl path prefix → ours (`actor_rollout_ref.actor.optim.lr` → `actor.optim.lr`);
  - `expand_verl_values`: keys whose value maps onto several of our keys — `data.filter_overlong_prompts` with
    `data.truncation` onto the over-long row handling, `*.model.enable_gradient_checkpointing` onto that role's
    Megatron recompute settings;
  - `UNSUPPORTED_VERL`: prefixes refused with the reason (offline PPO has no rollout and serves no reward model).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_ppo.config.errors import ConfigError

# verl path prefix → ours. Longest prefix wins.
VERL_ALIASES = {
    "actor_rollout_ref.actor.": "actor.",
    "actor_rollout_ref.ref.": "ref.",
    "actor_rollout_ref.model.path": "model.hf_checkpoint",
    "critic.model.path": "critic.model.hf_checkpoint",
    # verl's LoRA (`lora.rank`, `lora.alpha`, `lora.target_modules`, `lora.merge`): the actor's and the critic's
    "actor_rollout_ref.model.lora.": "actor.lora.",
    "critic.model.lora.": "critic.lora.",
    # verl's remove-padding (packed sequences); ours is one switch for actor, reference and critic
    "actor_rollout_ref.model.use_remove_padding": "model.pack_sequences",
    "critic.model.use_remove_padding": "model.pack_sequences",
    "trainer.nnodes": "cluster.nodes",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node",
    "custom_reward_function.": "reward.custom_fn.",
}
UNSUPPORTED_VERL = {
    "actor_rollout_ref.rollout.": "offline PPO trains on a fixed dataset and has no rollout; set data.* instead",
    "reward_model.enable": "no reward model is served during training: rewards come from the dataset, scored "
    "beforehand by `megatron-ppo score` (reward_model.model.path) or when it is read (reward.score_fn)",
    "algorithm.rollout_correction.bypass_mode": "bypass mode (old_log_prob = the behaviour log-probs, no actor "
    "forward pass) is not built: old_log_prob is always the actor's own, and the behaviour log-probs enter through "
    "algorithm.rollout_correction.rollout_is / rollout_rs",
    "algorithm.rollout_correction.loss_type": "it chooses the loss of bypass mode, which is not built; choose the "
    "loss with actor.policy_loss.loss_mode",
}
ONE_PATH_OR_LIST = ("train_files", "val_files")  # data.* keys that take one path or a list, as in verl
# Overrides kept as written: YAML would read "0.5_2" (IcePop's band [0.5, 2]) as the number 0.52.
AS_WRITTEN = ("algorithm.rollout_correction.rollout_is_threshold", "algorithm.rollout_correction.rollout_rs_threshold")

# `<role>.model.enable_gradient_checkpointing` (verl) → the Megatron layout section whose recompute it sets. The
# reference runs without gradients, so verl's shared `actor_rollout_ref.model` setting reaches the actor only.
GRADIENT_CHECKPOINTING = {
    "actor_rollout_ref.model.enable_gradient_checkpointing": "actor.megatron",
    "critic.model.enable_gradient_checkpointing": "critic.megatron",
}
# Gradient checkpointing as Megatron-LM's full activation recompute of every layer (what Hugging Face's
# gradient_checkpointing does: each layer's input is kept, its inside recomputed in the backward); off: none.
RECOMPUTE_ON = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
RECOMPUTE_OFF = {"recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None}

FILTER_OVERLONG, TRUNCATION = "data.filter_overlong_prompts", "data.truncation"
VERL_TRUNCATION = ("error", "left", "right", "middle")


@dataclass(frozen=True)
class Override:
    """One command-line override: `key` is ours, `written` the key as the user wrote it (a verl path, say)."""

    key: str
    value: Any
    written: str
    delete: bool = False  # Hydra's `~key`: back to the schema default
    added: bool = False  # written with Hydra's `+key=`, which adds a key to a Hydra config


def alias(key: str) -> str:
    """Our path for a verl path (unchanged when it is ours already); a refused verl prefix raises."""
    for prefix, reason in UNSUPPORTED_VERL.items():
        if key.startswith(prefix):
            raise ConfigError([f"override {key}: {reason}"])
    for prefix in sorted(VERL_ALIASES, key=len, reverse=True):
        if key == prefix or key.startswith(prefix):
            return VERL_ALIASES[prefix] + key[len(prefix) :]
    return key


def expand_verl_values(overrides: list[Override]) -> list[Override]:
    """The overrides with each value-mapped verl key replaced by the keys of ours it sets (in its place).

    `data.filter_overlong_prompts` and `data.truncation` are read together, wherever they stand, as verl reads
    them: over-long prompts are filtered when the first is true; otherwise `truncation` decides (verl's default:
    error). `data.overlong_policy` = filter | error | truncate, and `truncation`'s side sets
    `data.prompt_truncation`."""
    overlong = {o.key: o for o in overrides if o.key in (FILTER_OVERLONG, TRUNCATION)}  # the last of each wins
    last = max((i for i, o in enumerate(overrides) if o.key in overlong), default=-1)
    deleted = [o for o in overrides if o.delete and (o.key in GRADIENT_CHECKPOINTING or o.key in overlong)]
    if deleted:
        raise ConfigError([f"~{o.written}: this verl key sets several of ours, so it cannot be deleted; set it, or "
                           "delete the keys it sets (docs/reference/verl-keys.md)" for o in deleted])  # fmt: skip
    expanded: list[Override] = []
    for index, override in enumerate(overrides):
        if override.key in GRADIENT_CHECKPOINTING:
            expanded += _gradient_checkpointing(override)
        elif override.key in overlong:
            if index == last:  # both read once, where the later of them stands
                expanded += _overlong(overlong.get(FILTER_OVERLONG), overlong.get(TRUNCATION))
        else:
            expanded.append(override)
    return expanded


def _gradient_checkpointing(override: Override) -> list[Override]:
    if not isinstance(override.value, bool):
        raise ConfigError(
            [f"{override.written}={override.value!r}: give true or false (true: full recompute of every layer)"]
        )
    section = GRADIENT_CHECKPOINTING[override.key]
    settings = RECOMPUTE_ON if override.value else RECOMPUTE_OFF
    return [replace(override, key=f"{section}.{name}", value=value) for name, value in settings.items()]


def _overlong(filtered: Override | None, truncation: Override | None) -> list[Override]:
    problems = []
    if filtered is not None and not isinstance(filtered.value, bool):
        problems.append(f"{FILTER_OVERLONG}={filtered.value!r}: give true or false")
    if truncation is not None and truncation.value not in VERL_TRUNCATION:
        problems.append(f"{TRUNCATION}={truncation.value!r}: give one of {', '.join(VERL_TRUNCATION)}")
    if problems:
        raise ConfigError(problems)
    side = truncation.value if truncation is not None else "error"  # verl's default
    source = truncation or filtered
    out = []
    if filtered is not None and filtered.value:
        out.append(replace(filtered, key="data.overlong_policy", value="filter"))
    else:
        out.append(replace(source, key="data.overlong_policy", value="error" if side == "error" else "truncate"))
    if side != "error":
        out.append(replace(source, key="data.prompt_truncation", value=side))
    return out
