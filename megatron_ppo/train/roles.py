"""The three models of a run, their optimizers, learning-rate schedules and host offload: built from the config and
the initial weights (`build_roles`), then handed as one `Roles` to the parts that run, save or roll them back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_ppo.checkpoint import store
from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.config.schema import ROLES, PPOConfig
from megatron_ppo.convert.critic_init import load_critic
from megatron_ppo.models import build_role_model, copy_weights
from megatron_ppo.models.gpt import RoleModel, base_reference
from megatron_ppo.models.offload import HostOffload
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler


@dataclass
class Roles:
    actor: RoleModel
    ref: RoleModel | None
    critic: RoleModel | None
    models: dict[str, RoleModel]  # the trained ones: actor, and critic when there is one
    optimizers: dict[str, Any]
    schedulers: dict[str, Any]
    offload: HostOffload
    critic_source: str | None  # where the critic's weights came from (logged at the start)

    def built(self) -> dict[str, RoleModel]:
        """Every model the run holds, by role."""
        return {role: model for role in ROLES if (model := getattr(self, role)) is not None}


def build_roles(config: PPOConfig, weights: InitialWeights, total_steps: int, report: Callable[[str], None]) -> Roles:
    """The actor (routing replay, LoRA), its reference (its own model, or with LoRA the actor's base with the
    adapters off; none without a KL), the critic (none for GRPO), each from `weights` (or the reference from the
    actor's random start under `model.allow_random_init`); an optimizer and schedule per trained role over the run's
    `total_steps` × its mini-batches an iteration; host offload by each role's `megatron.*_offload` (`report`: its
    log line)."""
    layout = config.actor.megatron
    replay = config.actor.router_replay.mode != "disabled"
    actor = build_role_model("actor", config.model, layout, routing_replay=replay, lora=config.actor.lora)
    ref = None
    if config.needs_reference and config.actor.lora.enabled:  # no third model: the actor's base, adapters off
        ref = base_reference(actor)
    elif config.needs_reference:
        ref = build_role_model("ref", config.model, config.ref.megatron)
    critic = build_role_model("critic", config.model, config.critic.megatron, lora=config.critic.lora) \
        if config.needs_critic else None  # fmt: skip
    own_ref = ref if ref is not None and not ref.adapters_off else None
    if weights.actor:
        for model in (actor, own_ref):
            if model is not None:
                store.load_weights(model, weights.actor, "actor")
    elif own_ref is not None:  # model.allow_random_init: the reference is the actor's starting point
        copy_weights(actor, own_ref)
    critic_source = load_critic(critic, weights) if critic is not None else None
    models = {"actor": actor} | ({"critic": critic} if critic else {})
    optimizers, schedulers = {}, {}
    for role, model in models.items():
        role_config = getattr(config, role)
        mini_batches = config.data.train_batch_size // role_config.ppo_mini_batch_size * role_config.ppo_epochs
        optimizers[role] = build_optimizer(model, role_config.optim, role_config.megatron)
        schedulers[role] = build_scheduler(optimizers[role], role_config.optim, total_steps * mini_batches)
    offload = HostOffload(
        {role: (model, optimizers.get(role), getattr(config, role).megatron)
         for role, model in (("actor", actor), ("ref", own_ref), ("critic", critic)) if model},
        report=report,
    )  # fmt: skip
    return Roles(actor, ref, critic, models, optimizers, schedulers, offload, critic_source)
