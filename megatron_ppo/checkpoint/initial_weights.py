"""The checkpoints a run's models start from, chosen once at its start and passed to model building (never written
into the config): the recipe's `model.init_checkpoint` / `critic.model.init_checkpoint`, the conversion of its
`*.hf_checkpoint` on first use (`train/run.py`), or a task's own initial policy (the tiny recipe's SFT)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ppo.config.schema import PPOConfig


@dataclass(frozen=True)
class InitialWeights:
    """`actor`: a megatron-ppo checkpoint whose "actor" initialises the actor, the reference and (by default) the
    critic's trunk; None: the weights as built (`model.allow_random_init`). `critic`: the critic's own checkpoint
    (`critic_init.load_critic`); None: the actor's trunk."""

    actor: str | None = None
    critic: str | None = None

    @classmethod
    def of(cls, config: PPOConfig) -> InitialWeights:
        """The checkpoints the config names itself."""
        return cls(config.model.init_checkpoint, config.critic.model.init_checkpoint)
