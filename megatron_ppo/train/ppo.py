"""The offline PPO loop: read rows → experience → advantages → critic/actor updates → KL control, guards,
metrics, checkpoints (`docs/design.md`, "One PPO iteration"; `PPOTrainer.iteration` numbers the steps)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_ppo import algo, checkpoint
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.data.rows import Row
from megatron_ppo.models import RoleModel, build_role_model, copy_weights
from megatron_ppo.models.gpt import sync_parameters
from megatron_ppo.models.kernels import describe_kernels
from megatron_ppo.models.offload import HostOffload
from megatron_ppo.parallel.device import current_device, to_device
from megatron_ppo.train.batch import build_sampler, collate
from megatron_ppo.train.experience import Experience, compute_advantages, experience_metrics, forward_passes
from megatron_ppo.train.guards import GuardAction, Guards, scale_learning_rate
from megatron_ppo.train.kl_coefficients import KLCoefficients
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from megatron_ppo.train.preemption import (
    JobBudget,
    JobBudgetReached,
    Preempted,
    PreemptionWatch,
    mark_preempted,
    watching,
)
from megatron_ppo.train.run_start import start_run
from megatron_ppo.train.throughput import phase_timer, throughput_metrics, timing_metrics
from megatron_ppo.train.update import RoleUpdate, actor_loss, critic_loss, update_role

Evaluate = Callable[[RoleModel], dict[str, float]]


class PPOTrainer:
    """Owns the three models, their optimizers and schedules, the KL coefficients, the data order and the logs."""

    def __init__(self, config: PPOConfig, rows: Sequence[Row], pad_id: int, evaluate: Evaluate | None = None) -> None:
        self.config, self.rows, self.pad_id, self.evaluate = config, rows, pad_id, evaluate
        trainer, layout = config.trainer, config.actor.megatron
        self.sampler, sampled_rows, grouping = build_sampler(config, rows)
        steps_per_epoch = sampled_rows // config.data.train_batch_size
        if steps_per_epoch == 0:
            raise ValueError(
                f"{sampled_rows} rows cannot fill one batch of data.train_batch_size={config.data.train_batch_size}"
            )
        self.total_steps = trainer.total_training_steps or steps_per_epoch * trainer.total_epochs
        self.run = start_run(config)  # before the models are built: a run that may not start refuses at once
        self.logger = MetricsLogger(self.run.log_dir, trainer.logger, self.total_steps)
        uses_kl = config.actor.use_kl_loss or config.algorithm.use_kl_in_reward
        self.actor = build_role_model("actor", config.model, layout)
        self.ref = build_role_model("ref", config.model, config.ref.megatron) if uses_kl else None
        self.critic = (
            build_role_model("critic", config.model, config.critic.megatron)
            if config.algorithm.adv_estimator == "gae"
            else None
        )
        if config.model.init_checkpoint:
            for model in (self.actor, self.ref):
                if model is not None:
                    checkpoint.load_weights(model, config.model.init_checkpoint, "actor")
            if self.critic is not None:
                checkpoint.load_weights(self.critic, config.model.init_checkpoint, "actor", drop=("output_layer",))
        elif self.ref is not None:  # model.allow_random_init: the reference is the actor's starting point
            copy_weights(self.actor, self.ref)
        self.models = {"actor": self.actor} | ({"critic": self.critic} if self.critic else {})
        self.logger.event(0, "kernels", describe_kernels(config))
        self.optimizers, self.schedulers = {}, {}
        minibatches = {
            "actor": config.data.train_batch_size // config.actor.ppo_mini_batch_size * config.actor.ppo_epochs,
            "critic": config.data.train_batch_size // config.critic.ppo_mini_batch_size * config.critic.ppo_epochs,
        }
        for role, model in self.models.items():
            role_config = getattr(config, role)
            self.optimizers[role] = build_optimizer(model, role_config.optim, role_config.megatron)
            self.schedulers[role] = build_scheduler(
                self.optimizers[role], role_config.optim, self.total_steps * minibatches[role]
            )
        # host offload between phases: each role's weights, gradients, optimizer states by its megatron.*_offload
        self.offload = HostOffload(
            {role: (model, self.optimizers.get(role), getattr(config, role).megatron)
             for role, model in (("actor", self.actor), ("ref", self.ref), ("critic", self.critic)) if model},
            report=lambda line: self.logger.event(self.step, "offload", line),
        )  # fmt: skip
        self.kl = KLCoefficients(config, self.total_steps)
        self.normalizer = algo.RunningRewardNormalizer() if config.reward.normalize else None
        self.guards = Guards(config.guards)
        self.step = 0
        self.skipped_steps = 0
        self.logger.event(0, "run", f"{trainer.project_name}/{trainer.experiment_name}")
        if grouping:
            self.logger.event(0, "data", grouping)
        self.history: list[dict[str, float]] = []

    # --- state ---------------------------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "sampler": self.sampler.state_dict(),
            "kl": self.kl.state_dict(),
            "schedulers": {role: s.state_dict() for role, s in self.schedulers.items()},
            "normalizer": self.normalizer.state_dict() if self.normalizer else None,
            "guards": self.guards.state_dict(),
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl.load_state_dict(state["kl"])
        for role, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state["schedulers"][role])
        if self.normalizer is not None and state["normalizer"] is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        self.guards.load_state_dict(state["guards"])

    def save(self) -> Path:
        for model in self.models.values():
            sync_parameters(model)  # a distributed-optimizer step may still be gathering weights (CUDA overlap)
        path = checkpoint.save_checkpoint(
            self.config.trainer.default_local_dir, self.step, self.models, self.optimizers, self.trainer_state(),
            run=self.run.identity, keep=self.config.trainer.max_ckpt_to_keep,
        )  # fmt: skip
        self.logger.event(self.step, "checkpoint", f"saved {path}")
        return path

    def resume(self) -> Path | None:
        """Load the checkpoint `start_run` chose (None: a new run), and log what the start decided."""
        path = self.run.resume_from
        if path is not None:
            self.load_trainer_state(checkpoint.load_checkpoint(path, self.models, self.optimizers))
        for message in self.run.messages:
            self.logger.event(self.step, "run", message)
        return path

    # --- one iteration -------------------------------------------------------------------------------------------
    def iteration(self) -> dict[str, float]:
        """One PPO iteration, in the order of the algorithm; returns its metrics."""
        config, timings = self.config, {}
        with phase_timer(timings, "iteration"):
            # 1. batch: the next train_batch_size rows, tokenized, right-padded and on the run's device
            rows = [self.rows[i] for i in self.sampler.next_batch(config.data.train_batch_size)]
            batch = to_device(collate(rows, self.pad_id), current_device(), "the PPO batch")
            with phase_timer(timings, "experience"):
                # 2. experience: log-probs of actor and reference, values of the critic (no grad; on every rank)
                self.offload.enter("experience")
                passes = forward_passes(config, batch, self.actor, self.ref, self.critic)
                # 3. advantages: token rewards (clipped score, minus β·KL when the KL is in the reward), GAE or GRPO
                experience, metrics = compute_advantages(config, batch, passes, self.kl.coef("reward"), self.normalizer)
            metrics |= experience_metrics(config, experience)
            # 4. critic update: clipped value loss on the returns
            updates = [self._update("critic", experience, timings)] if self.critic is not None else []
            # 5. actor update: clipped surrogate + β·KL − entropy bonus, once the critic has warmed up
            if self.step >= config.trainer.critic_warmup:
                updates.append(self._update("actor", experience, timings))
            for update in updates:
                metrics |= update.metrics
                self.skipped_steps += update.skipped
            self.offload.enter("between iterations")  # checkpoints, rollbacks, evaluation read weights and optimizers
            self.step += 1
            # 6. KL control: β for the next iteration from this one's KL (stage-aware)
            metrics |= self.kl.step(metrics.get("kl/mean"), config.data.train_batch_size)
            # 7. guards: back off, roll back or stop on spikes, KL explosions and non-finite steps
            skipped = any(update.skipped for update in updates)
            self._act(self.guards.observe(metrics, skipped, self.kl.guard_overrides))
        # 8. metrics: counters, timings and throughput (MFU from the planner's FLOP count)
        return metrics | self._throughput(batch["lengths"], timings)

    def _throughput(self, lengths: torch.Tensor, timings: dict[str, float]) -> dict[str, float]:
        tokens, seconds = float(lengths.sum()), timings["iteration"]
        roles = [role for role in ("actor", "ref", "critic") if getattr(self, role) is not None]
        return {
            "train/skipped_steps": float(self.skipped_steps), "perf/step_time_s": seconds,
            "perf/tokens_per_s": tokens / seconds,
            **throughput_metrics(self.config, roles, lengths.cpu(), timings), **timing_metrics(timings),
        }  # fmt: skip

    def _update(self, role: str, experience: Experience, timings: dict[str, float]) -> RoleUpdate:
        """`ppo_epochs` passes of `role` over the mini-batches of `experience`, timed as `update_<role>`."""
        role_config = getattr(self.config, role)
        if role == "actor":
            actor = self.actor
            make_loss = partial(actor_loss, role_config, kl_loss_coef=self.kl.coef("loss") or 0.0,
                                vocab_size=actor.vocab_size, chunk_tokens=actor.logprob_chunk_tokens)  # fmt: skip
        else:
            make_loss = partial(critic_loss, role_config)
        with phase_timer(timings, f"update_{role}"):
            self.offload.enter(f"{role} update")
            return update_role(
                role, self.models[role], self.optimizers[role], self.schedulers[role], experience,
                epochs=role_config.ppo_epochs, mini_batch_size=role_config.ppo_mini_batch_size,
                micro_batch_size=role_config.ppo_micro_batch_size_per_gpu,
                max_tokens=role_config.ppo_max_token_len_per_gpu if role_config.use_dynamic_bsz else None,
                clip_grad=role_config.optim.clip_grad, make_loss=make_loss,
            )  # fmt: skip

    def _act(self, actions: list[GuardAction]) -> None:
        """Carry out what the guards asked for, each with its message in the logs."""
        for action in actions:
            self.logger.event(self.step, "guard", action.message)
            if action.kind == "stop":
                raise RuntimeError(action.message)
            if action.kind == "lr_backoff":
                scale_learning_rate(self.schedulers[action.role], action.lr_factor)
            elif action.kind == "rollback":
                self._roll_back(action.lr_factor, action.max_rollbacks)

    def _roll_back(self, lr_factor: float, max_rollbacks: int) -> None:
        """Restore the last good checkpoint with lower learning rates (the guards keep their own counters)."""
        guards = self.guards
        path = checkpoint.latest_of_run(self.config.trainer.default_local_dir, self.run.identity.run_id)
        if path is None or guards.rollbacks >= max_rollbacks:
            reason = (
                "no checkpoint of this run yet" if path is None else f"guards.max_rollbacks={max_rollbacks} reached"
            )
            self.logger.event(self.step, "guard", f"rollback not possible: {reason}; continuing")
            return
        counters = guards.state_dict()
        self.load_trainer_state(checkpoint.load_checkpoint(path, self.models, self.optimizers))
        guards.load_state_dict(counters)
        guards.rollbacks += 1
        for scheduler in self.schedulers.values():
            scale_learning_rate(scheduler, lr_factor)
        self.logger.event(self.step, "guard", f"rolled back to {path}, learning rates × {lr_factor}")

    # --- the loop ------------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train to `total_steps`. On a preemption signal, save after the current iteration and raise `Preempted`;
        when this job's budget (`trainer.exit_interval`, `exit_duration_in_mins`) is spent, save and raise
        `JobBudgetReached`."""
        with watching() as watch:
            self._fit(watch, JobBudget(self.config.trainer.exit_interval, self.config.trainer.exit_duration_in_mins))
        return self.history

    def _fit(self, watch: PreemptionWatch, budget: JobBudget) -> None:
        trainer = self.config.trainer
        if self.step >= self.total_steps:
            self.logger.event(self.step, "finished", f"the run already reached its {self.total_steps} steps")
            return
        while self.step < self.total_steps:
            metrics = self.iteration()
            if self.evaluate is not None and trainer.test_freq and self.step % trainer.test_freq == 0:
                metrics |= {f"eval/{k}": v for k, v in self.evaluate(self.actor).items()}
            self.logger.log(self.step, metrics)
            self.history.append({"step": float(self.step), **metrics})
            if watch.agreed():
                path = self.save()
                self.logger.event(self.step, "preempted", f"signal received; checkpoint {path}, exiting to requeue")
                mark_preempted()
                raise Preempted(str(path))
            if self.step < self.total_steps and (reason := budget.reason(self.step)):
                path = self.save()
                self.logger.event(self.step, "job budget", f"{reason}; checkpoint {path}, the next job resumes")
                raise JobBudgetReached(str(path))
            if trainer.save_freq and self.step % trainer.save_freq == 0 and self.step < self.total_steps:
                self.save()
        self.save()

    def close(self) -> None:
        self.logger.close()
