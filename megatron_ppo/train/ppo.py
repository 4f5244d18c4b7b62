"""The offline PPO loop: read rows → experience → advantages → actor/critic updates → KL control, guards,
metrics, checkpoints (see `../shared/DESIGN.md`, "The data flow of one PPO iteration")."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_ppo import algo, checkpoint
from megatron_ppo.algo import StagedKLSchedule
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.data.batching import EpochSampler
from megatron_ppo.data.rows import Row
from megatron_ppo.models import RoleModel, build_role_model
from megatron_ppo.parallel.collectives import broadcast_from_last_stage
from megatron_ppo.train.batch import collate
from megatron_ppo.train.experience import compute_advantages, compute_experience
from megatron_ppo.train.guards import Guards, scale_learning_rate
from megatron_ppo.train.kl_coefficients import build_kl_coefficients
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
from megatron_ppo.train.update import actor_loss, critic_loss, update_role

Evaluate = Callable[[RoleModel], dict[str, float]]


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class PPOTrainer:
    """Owns the three models, their optimizers and schedules, the KL coefficients, the data order and the logs."""

    def __init__(self, config: PPOConfig, rows: Sequence[Row], pad_id: int, evaluate: Evaluate | None = None) -> None:
        self.config, self.rows, self.pad_id, self.evaluate = config, rows, pad_id, evaluate
        trainer, layout = config.trainer, config.actor.megatron
        steps_per_epoch = len(rows) // config.data.train_batch_size
        if steps_per_epoch == 0:
            raise ValueError(
                f"{len(rows)} rows cannot fill one batch of data.train_batch_size={config.data.train_batch_size}"
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
        self.models = {"actor": self.actor} | ({"critic": self.critic} if self.critic else {})
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
        self.kl_coefficients = build_kl_coefficients(config, self.total_steps)
        self.normalizer = algo.RunningRewardNormalizer() if config.reward.normalize else None
        self.sampler = EpochSampler(len(rows), seed=config.data.seed, shuffle=config.data.shuffle)
        self.guards = Guards(config.guards)
        self.step = 0
        self.skipped_steps = 0
        self.history: list[dict[str, float]] = []

    # --- state ---------------------------------------------------------------------------------------------------
    def trainer_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "skipped_steps": self.skipped_steps,
            "sampler": self.sampler.state_dict(),
            "kl": {term: c.state_dict() for term, c in self.kl_coefficients.items()},
            "schedulers": {role: s.state_dict() for role, s in self.schedulers.items()},
            "normalizer": self.normalizer.state_dict() if self.normalizer else None,
            "guards": self.guards.state_dict(),
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        self.sampler.load_state_dict(state["sampler"])
        for term, controller in self.kl_coefficients.items():
            controller.load_state_dict(state["kl"][term])
        for role, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state["schedulers"][role])
        if self.normalizer is not None and state["normalizer"] is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        self.guards.load_state_dict(state["guards"])

    def save(self) -> Path:
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
        config = self.config
        started = time.perf_counter()
        batch = collate([self.rows[i] for i in self.sampler.next_batch(config.data.train_batch_size)], self.pad_id)
        experience = compute_experience(config, batch, self.actor, self.ref, self.critic)
        reward_coef = self.kl_coefficients["reward"].value if "reward" in self.kl_coefficients else None
        metrics: dict[str, float] = {}
        if experience is not None:
            experience, metrics = compute_advantages(config, experience, reward_coef, self.normalizer)
            metrics |= self._experience_metrics(experience)
        experience = experience if experience is not None else batch
        critic_metrics, critic_steps = [], []
        if self.critic is not None:
            critic_metrics, critic_steps = update_role(
                self.critic, self.optimizers["critic"], self.schedulers["critic"], experience,
                epochs=config.critic.ppo_epochs, mini_batch_size=config.critic.ppo_mini_batch_size,
                micro_batch_size=config.critic.ppo_micro_batch_size_per_gpu,
                max_tokens=config.critic.ppo_max_token_len_per_gpu if config.critic.use_dynamic_bsz else None,
                clip_grad=config.critic.optim.clip_grad, make_loss=lambda counts: critic_loss(config.critic, counts),
            )  # fmt: skip
        actor_metrics, actor_steps = [], []
        if self.step >= config.trainer.critic_warmup:
            loss_coef = self.kl_coefficients["loss"].value if "loss" in self.kl_coefficients else 0.0
            actor_metrics, actor_steps = update_role(
                self.actor, self.optimizers["actor"], self.schedulers["actor"], experience,
                epochs=config.actor.ppo_epochs, mini_batch_size=config.actor.ppo_mini_batch_size,
                micro_batch_size=config.actor.ppo_micro_batch_size_per_gpu,
                max_tokens=config.actor.ppo_max_token_len_per_gpu if config.actor.use_dynamic_bsz else None,
                clip_grad=config.actor.optim.clip_grad,
                make_loss=lambda counts: actor_loss(config.actor, counts, loss_coef, self.actor.vocab_size),
            )  # fmt: skip
        for key in {k for m in actor_metrics + critic_metrics for k in m}:
            metrics[key] = _mean([m[key] for m in actor_metrics + critic_metrics if key in m])
        metrics = broadcast_from_last_stage(metrics)
        for role, steps in (("actor", actor_steps), ("critic", critic_steps)):
            if steps:
                finite = [s.grad_norm for s in steps if math.isfinite(s.grad_norm)]
                metrics[f"{role}/grad_norm"] = _mean(finite)
                metrics[f"{role}/grad_norm_max"] = max(finite, default=float("nan"))
                metrics[f"{role}/lr"] = self.optimizers[role].param_groups[0]["lr"]
                self.skipped_steps += sum(s.skipped for s in steps)
        metrics |= self._kl_control(metrics.get("kl/mean"), config.data.train_batch_size)
        self.step += 1
        elapsed = time.perf_counter() - started
        tokens = float(batch["lengths"].sum())
        metrics |= {"train/skipped_steps": float(self.skipped_steps), "perf/step_time_s": elapsed,
                    "perf/tokens_per_s": tokens / elapsed}  # fmt: skip
        overrides = next(
            (c.guard_overrides for c in self.kl_coefficients.values() if isinstance(c, StagedKLSchedule)), None
        )
        skipped = any(s.skipped for s in actor_steps + critic_steps)
        for event in self.guards.observe(self.step, metrics, self.schedulers, skipped, overrides):
            self.logger.event(self.step, "guard", event)
        if self.guards.rollback_requested:
            self._roll_back()
        return metrics

    def _roll_back(self) -> None:
        """Restore the last good checkpoint with lower learning rates (the guards keep their own counters)."""
        guards = self.guards
        guards.rollback_requested = False
        path = checkpoint.latest_of_run(self.config.trainer.default_local_dir, self.run.identity.run_id)
        if path is None or guards.rollbacks >= guards.base.max_rollbacks:
            reason = (
                "no checkpoint of this run yet"
                if path is None
                else f"guards.max_rollbacks={guards.base.max_rollbacks} reached"
            )
            self.logger.event(self.step, "guard", f"rollback not possible: {reason}; continuing")
            return
        counters = guards.state_dict()
        self.load_trainer_state(checkpoint.load_checkpoint(path, self.models, self.optimizers))
        guards.load_state_dict(counters)
        guards.rollbacks += 1
        for scheduler in self.schedulers.values():
            scale_learning_rate(scheduler, guards.base.rollback_lr_factor)
        self.logger.event(
            self.step, "guard", f"rolled back to {path}, learning rates × {guards.base.rollback_lr_factor}"
        )

    def _experience_metrics(self, experience) -> dict[str, float]:
        mask = experience["loss_mask"]
        out = {"response_length/mean": float(mask.sum(-1).mean())}
        if "ref_log_prob" in experience:
            kind = self.config.actor.kl_loss_type if self.config.actor.use_kl_loss else self.config.algorithm.kl_penalty
            kl = algo.kl_penalty(experience["old_log_prob"], experience["ref_log_prob"], kind)
            per_sequence = algo.masked_mean(kl, mask, dim=-1)
            out |= {"kl/mean": float(per_sequence.mean()), "kl/std": float(per_sequence.std())}
        if "values" in experience:
            out["critic/values_mean"] = float(algo.masked_mean(experience["values"], mask))
            out["critic/vf_explained_var"] = float(
                algo.explained_variance(experience["values"], experience["returns"], mask)
            )
        return out

    def _kl_control(self, current_kl: float | None, batch_rows: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for term, controller in self.kl_coefficients.items():
            name = "kl/coef" if term == "loss" else "kl/reward_coef"
            out[name] = controller.value
            if isinstance(controller, StagedKLSchedule):
                out["kl/stage"] = float(controller.stage_index)
                if controller.stage.target_kl is not None:  # a warm-up stage has none
                    out["kl/target"] = controller.stage.target_kl
            elif controller.kind != "fixed":
                out["kl/target"] = self.config.algorithm.kl_ctrl.target_kl
            if current_kl is not None and math.isfinite(current_kl):
                controller.update(current_kl, n_steps=batch_rows)
        return out

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
