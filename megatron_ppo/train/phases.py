"""Where an iteration's work runs, phase by phase (`planner.phases.Phase`): each phase timed (the trainer's timers and
the profiler's ranges), the roles' state placed for it (host offload), retried with smaller micro-batches while any
rank runs out of memory (`memory_backoff.py`), and which roles update at a step (the critic always, the actor once
the critic has warmed up, `trainer.critic_warmup`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.models.failed_pass import release_failed_pass
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train import profiling
from megatron_ppo.train.experience import Experience, forward_passes
from megatron_ppo.train.kl_coefficients import KLCoefficients
from megatron_ppo.train.memory_backoff import OutOfMemoryBackoff
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.optimizer import zero_grads
from megatron_ppo.train.roles import Roles
from megatron_ppo.train.run_state import RunState
from megatron_ppo.train.throughput import phase_timer
from megatron_ppo.train.update import RoleUpdate, role_loss, update_role

T = TypeVar("T")


class Phases:
    def __init__(self, config: PPOConfig, roles: Roles, kl: KLCoefficients, memory: OutOfMemoryBackoff,
                 state: RunState, logger: MetricsLogger, profiler: profiling.Profiler) -> None:  # fmt: skip
        self.config, self.roles, self.kl, self.memory = config, roles, kl, memory
        self.state, self.logger, self.profiler = state, logger, profiler
        self.updated_roles = ["critic"] if roles.critic is not None else []

    @contextmanager
    def running(self, phase: Phase, timings: dict[str, float]) -> Iterator[None]:
        """`phase` timed (`timings[phase.metric]`, a profiler range), the roles' state placed for it."""
        with phase_timer(timings, phase.metric), profiling.phase(phase.metric):
            self.roles.offload.enter(phase)
            yield

    def experience(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The experience's forward passes (log-probs of actor and reference, values of the critic; no grad)."""
        roles = self.roles
        return self.retry(Phase.EXPERIENCE, lambda: forward_passes(
            self.config, batch, roles.actor, roles.ref, roles.critic, self.memory.micro_batching(Phase.EXPERIENCE)
        ))  # fmt: skip

    def roles_to_update(self, step: int) -> list[str]:
        """The critic, then the actor once `trainer.critic_warmup` steps are done."""
        return self.updated_roles + (["actor"] if step >= self.config.trainer.critic_warmup else [])

    def update(self, role: str, experience: Experience, timings: dict[str, float]) -> RoleUpdate:
        """`ppo_epochs` passes of `role` over the mini-batches of `experience` (`Phase.update(role)`); each
        mini-batch's forward-backward is retried on its own, before its optimizer step (memory_backoff.py)."""
        roles, phase = self.roles, Phase.update(role)
        make_loss = role_loss(role, self.config, roles.models[role], self.kl.coef("loss") or 0.0, roles.ref is not None)
        with self.running(phase, timings):
            return update_role(
                role, roles.models[role], roles.optimizers[role], roles.schedulers[role], experience,
                config=getattr(self.config, role), micro=lambda: self.memory.micro_batching(phase)[role],
                make_loss=make_loss, retry=partial(self.retry, phase),
            )  # fmt: skip

    def between_iterations(self) -> None:
        """Checkpoints, rollbacks and evaluation read weights and optimizer states: placed for them."""
        self.roles.offload.enter(Phase.BETWEEN_ITERATIONS)

    def retry(self, phase: Phase, attempt: Callable[[], T]) -> T:
        """`attempt()`, run again with smaller micro-batches while any rank runs out of memory."""
        return self.memory.run(phase, attempt, self._free, self._out_of_memory)

    def _free(self) -> None:
        roles = self.roles
        for model in roles.built().values():  # the activations the layers still hold (models/failed_pass.py)
            release_failed_pass(model)
        for role, model in roles.models.items():
            if roles.offload.holds(role, "grads"):  # offloaded gradients hold no memory (and come back zeroed)
                zero_grads(model, roles.optimizers[role])

    def _out_of_memory(self, message: str) -> None:
        """Logged at the number of the iteration under way."""
        self.profiler.out_of_memory()
        self.logger.event(self.state.step + 1, "guard/out_of_memory", message)
        self.logger.log(self.state.step + 1, {"guard/out_of_memory": float(self.memory.retries)})
