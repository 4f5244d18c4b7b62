"""The rules of `actor.lora.*` and `critic.lora.*` across keys (each key's own range is on its schema field): what
LoRA cannot serve is refused before any model is built, with the change that makes it run."""

from __future__ import annotations

import dataclasses

from megatron_ppo.config.schema import TRAINED_ROLES, PPOConfig


def lora_problems(c: PPOConfig) -> list[str]:
    p: list[str] = []
    for role in TRAINED_ROLES:
        lora, key = getattr(c, role).lora, f"{role}.lora"
        if not lora.enabled:
            if lora.merge:
                p.append(f"{key}.merge=true merges adapters, but {key}.rank=0 trains none; drop {key}.merge or set "
                         f"{key}.rank (e.g. 8)")  # fmt: skip
            continue
        if not lora.target_modules:
            p.append(f"{key}.target_modules is empty: no layer would be trained; name some of linear_qkv, "
                     f"linear_proj, linear_fc1, linear_fc2, or set {key}.rank=0")  # fmt: skip
        if c.model.num_experts:
            p.append(f"{key}.rank={lora.rank}: adapters on the experts' layers are not built (model.num_experts="
                     f"{c.model.num_experts}); train this mixture-of-experts model in full ({key}.rank=0)")  # fmt: skip
        if c.model.transformer_impl == "transformer_engine":
            p.append(f"{key}.rank={lora.rank}: adapters sit on Megatron's local linear layers, not Transformer "
                     "Engine's; set model.transformer_impl=auto (LoRA builds the local spec) or local")  # fmt: skip
    if c.critic.lora.merge:
        p.append("critic.lora.merge=true: `convert mcore-to-hf` exports the actor only; drop critic.lora.merge")
    if c.actor.lora.enabled and c.needs_reference:
        p += _base_reference_problems(c)
    return p


# The layout keys a base reference may set apart from the actor's: the host-offload switches (it has no weights of
# its own to move), and what a forward without gradients never uses (the optimizer's sharding, recompute)
NOT_COMPARED = ("param_offload", "grad_offload", "optimizer_offload", "use_distributed_optimizer",
                "recompute_granularity", "recompute_method", "recompute_num_layers")  # fmt: skip


def _base_reference_problems(c: PPOConfig) -> list[str]:
    """The reference of a LoRA actor is the actor's own chunks with the adapters off: it runs at the actor's layout,
    and its weights move with the actor's (`actor.megatron.param_offload`)."""
    ref, actor, rank = c.ref.megatron, c.actor.megatron, c.actor.lora.rank
    differing = [f.name for f in dataclasses.fields(ref)
                 if f.name not in NOT_COMPARED and getattr(ref, f.name) != getattr(actor, f.name)]  # fmt: skip
    p = []
    if differing:
        shown = ", ".join(f"ref.megatron.{n}={getattr(ref, n)!r} (actor: {getattr(actor, n)!r})" for n in differing)
        p.append(f"with actor.lora.rank={rank} the reference is the actor's base model (its adapters off), run at the "
                 f"actor's layout, but {shown}; set ref.megatron like actor.megatron")  # fmt: skip
    if ref.param_offload:
        p.append(f"ref.megatron.param_offload=true: with actor.lora.rank={rank} the reference's weights are the "
                 "actor's; drop it (actor.megatron.param_offload moves them)")  # fmt: skip
    return p
