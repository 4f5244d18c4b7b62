"""The offline PPO loop: read rows → experience → advantages → critic/actor updates → KL control, guards,
metrics, checkpoints (`docs/design.md`, "One PPO iteration"; `PPOTrainer.iteration` numbers the steps).

The trainer sets up the run, runs its iterations and carries out what the guards ask for (`GUARD_ACTIONS`, one
handler per action kind); which saves are good, and so where a rollback or a stop goes, is the
`CheckpointKeeper`'s (`train/checkpoint_keeper.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_ppo import algo
from megatron_ppo.checkpoint import store
from megatron_ppo.checkpoint.async_save import SaveTiming
from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.checkpoint.run_start import start_run
from megatron_ppo.config.schema import ROLES, PPOConfig
from megatron_ppo.convert.critic_init import load_critic
from megatron_ppo.data.rows import Row
from megatron_ppo.models import build_role_model, copy_weights
from megatron_ppo.models.failed_pass import release_failed_pass
from megatron_ppo.models.gpt import RoleModel, base_reference
from megatron_ppo.models.kernels import describe_kernels
from megatron_ppo.models.offload import HostOffload
from megatron_ppo.models.widths import PaddingTally
from megatron_ppo.parallel.collectives import global_rank
from megatron_ppo.parallel.device import current_device, to_device
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train import profiling
from megatron_ppo.train.batch import build_sampler, collate
from megatron_ppo.train.callbacks import weak_callback
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper
from megatron_ppo.train.evaluation import Evaluator
from megatron_ppo.train.experience import (
    Experience,
    compute_advantages,
    experience_metrics,
    forward_passes,
    offpolicy_report,
)
from megatron_ppo.train.guards import ActionKind, GuardAction, Guards, GuardStopped, scale_learning_rate
from megatron_ppo.train.kl_coefficients import KLCoefficients
from megatron_ppo.train.kl_probe import KLProbe
from megatron_ppo.train.memory_backoff import OutOfMemoryBackoff
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler, zero_grads
from megatron_ppo.train.preemption import (
    Interrupted,
    JobBudget,
    JobBudgetReached,
    PreemptionWatch,
    mark_preempted,
    watching,
)
from megatron_ppo.train.throughput import padding_metrics, phase_timer, throughput_metrics, timing_metrics
from megatron_ppo.train.update import RoleUpdate, role_loss, update_role


class PPOTrainer:
    """Owns the three models, their optimizers and schedules, the KL coefficients, the data order and the logs."""

    def __init__(
        self,
        config: PPOConfig,
        rows: Sequence[Row],
        pad_id: int,
        evaluate: Evaluator | None = None,
        weights: InitialWeights | None = None,
    ) -> None:
        """`weights`: the checkpoints the models start from (chosen at the run's start, `train/run.py`); by default
        those the config names."""
        self.config, self.rows, self.pad_id, self.evaluate = config, rows, pad_id, evaluate
        weights = InitialWeights.of(config) if weights is None else weights
        trainer, layout = config.trainer, config.actor.megatron
        self.sampler, sampled_rows, grouping = build_sampler(config, rows)
        steps_per_epoch = sampled_rows // config.data.train_batch_size
        if steps_per_epoch == 0:
            raise ValueError(
                f"{sampled_rows} rows cannot fill one batch of data.train_batch_size={config.data.train_batch_size}"
            )
        self.total_steps = trainer.total_training_steps or steps_per_epoch * trainer.total_epochs
        self.run = start_run(config)  # before the models are built: a run that may not start refuses at once
        self.logger = MetricsLogger(
            self.run.log_dir, trainer.logger, self.total_steps, config=config, run_id=self.run.identity.run_id
        )
        replay = config.actor.router_replay.mode != "disabled"
        self.actor = build_role_model("actor", config.model, layout, routing_replay=replay, lora=config.actor.lora)
        self.ref = None
        if config.needs_reference and config.actor.lora.enabled:  # no third model: the actor's base, adapters off
            self.ref = base_reference(self.actor)
        elif config.needs_reference:
            self.ref = build_role_model("ref", config.model, config.ref.megatron)
        self.critic = build_role_model("critic", config.model, config.critic.megatron, lora=config.critic.lora) \
            if config.needs_critic else None  # fmt: skip
        own_ref = self.ref if self.ref is not None and not self.ref.adapters_off else None
        if weights.actor:
            for model in (self.actor, own_ref):
                if model is not None:
                    store.load_weights(model, weights.actor, "actor")
        elif own_ref is not None:  # model.allow_random_init: the reference is the actor's starting point
            copy_weights(self.actor, own_ref)
        critic_source = load_critic(self.critic, weights) if self.critic is not None else None
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
             for role, model in (("actor", self.actor), ("ref", own_ref), ("critic", self.critic)) if model},
            report=weak_callback(self._offload_event),
        )  # fmt: skip
        self.kl = KLCoefficients(config, self.total_steps)
        # the controllers' sensor with `kl_ctrl.feedback: probe`: KL after each update on fixed rows (kl_probe.py)
        probed = config.algorithm.kl_ctrl.feedback == "probe" and self.ref is not None
        self.probe = KLProbe(config, rows, pad_id) if probed else None
        self.normalizer = algo.RunningRewardNormalizer() if config.reward.normalize else None
        self.guards = Guards(config.guards)
        self.memory = OutOfMemoryBackoff(config)
        self.keeper = CheckpointKeeper(trainer, self.run.identity, report=weak_callback(self._report_save))
        self.evaluations: dict[int, dict[str, float]] = {}
        self.step = 0
        self.skipped_steps = 0
        self.profiler = profiling.Profiler(
            config.profiling, self.run.log_dir, global_rank(), say=weak_callback(self._profiling_event)
        )
        self.logger.event(0, "run", f"{trainer.project_name}/{trainer.experiment_name}")
        if critic_source is not None:
            self.logger.event(0, "critic", critic_source)
        if grouping:
            self.logger.event(0, "data", grouping)
        self._describe_evaluation()
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
            "memory": self.memory.state_dict(),
            **self.keeper.state_dict(),  # as of this save, which is itself unconfirmed
            "evaluation": self.evaluations.get(self.step),
        }

    def load_trainer_state(self, state: dict[str, Any]) -> None:
        """Everything but the keeper's state, which the keeper loads itself (`resume`, `roll_back_to`)."""
        self.step, self.skipped_steps = state["step"], state["skipped_steps"]
        self.sampler.load_state_dict(state["sampler"])
        self.kl.load_state_dict(state["kl"])
        for role, scheduler in self.schedulers.items():
            scheduler.load_state_dict(state["schedulers"][role])
        if self.normalizer is not None and state["normalizer"] is not None:
            self.normalizer.load_state_dict(state["normalizer"])
        self.guards.load_state_dict(state["guards"])
        self.memory.load_state_dict(state["memory"])

    def save(self, wait: bool = False) -> Path:
        """Checkpoint this step; `wait`: published before this returns (`trainer.async_save` writes in the
        background otherwise)."""
        with profiling.phase("save"):
            path, written = self.keeper.save(self.step, self.models, self.optimizers, self.trainer_state())
        if written:
            how = "writing in the background; " if self.keeper.saves is not None else ""
            self.logger.event(self.step, "checkpoint", f"saved {path} ({how}good once the next iteration's guards "
                              "pass)")  # fmt: skip
        if wait:
            self.keeper.wait()
        return path

    # The parts' reports, at the step under way; handed out as weak callbacks (train/callbacks.py: no cycle through
    # the parts the trainer holds).
    def _offload_event(self, line: str) -> None:
        self.logger.event(self.step, "offload", line)

    def _profiling_event(self, line: str) -> None:
        self.logger.event(self.step, "profiling", line)

    def _report_save(self, timing: SaveTiming) -> None:
        """A published save's cost, at its step: `timing/checkpoint_blocked_s`, how long training stopped for it (for
        an asynchronous save: its start, any wait for its write, and its finalisation), and
        `timing/checkpoint_write_s`, its whole write (wall-clock metrics, under `timing/` with the phases')."""
        blocked = timing.blocked_s + timing.waited_s + timing.finalised_s
        self.logger.log(
            timing.step, {"timing/checkpoint_blocked_s": blocked, "timing/checkpoint_write_s": timing.write_s}
        )
        how = "in the background" if timing.asynchronous else "synchronously"
        waited = f", {timing.waited_s:.2f} s of it waiting for the write" if timing.waited_s else ""
        self.logger.event(timing.step, "checkpoint", f"published {timing.path}: written {how} in "
                          f"{timing.write_s:.2f} s; training blocked {blocked:.2f} s{waited}")  # fmt: skip

    def resume(self) -> Path | None:
        """Load the checkpoint `start_run` chose (None: a new run), and log what the start decided."""
        path = self.run.resume_from
        if path is not None:
            self.load_trainer_state(self.keeper.resume(path, self.models, self.optimizers))
        if self.run.name_in_latest is not None:  # only now that it has loaded
            self.keeper.name_in_latest(self.run.name_in_latest)
        for message in self.run.messages:
            self.logger.event(self.step, "run", message)
        return path

    # --- one iteration -------------------------------------------------------------------------------------------
    def iteration(self) -> dict[str, float]:
        """One PPO iteration, in the order of the algorithm; returns its metrics."""
        config, timings = self.config, {}
        for model in self._built_roles().values():
            model.padding = PaddingTally()  # perf/padded_over_real_tokens counts this iteration's passes
        with phase_timer(timings, "iteration"):
            # 1. batch: the next train_batch_size rows, tokenized, right-padded and on the run's device
            rows = [self.rows[i] for i in self.sampler.next_batch(config.data.train_batch_size)]
            batch = to_device(collate(rows, self.pad_id), current_device(), "the PPO batch")
            with phase_timer(timings, Phase.EXPERIENCE.metric), profiling.phase(Phase.EXPERIENCE.metric):
                # 2. experience: log-probs of actor and reference, values of the critic (no grad; on every rank)
                self.offload.enter(Phase.EXPERIENCE)
                passes = self._retry_out_of_memory(Phase.EXPERIENCE, lambda: forward_passes(
                    config, batch, self.actor, self.ref, self.critic, self.memory.micro_batching(Phase.EXPERIENCE)
                ))  # fmt: skip
                # 3. advantages: token rewards (clipped score, minus β·KL when the KL is in the reward), GAE or GRPO
                experience, metrics = compute_advantages(config, batch, passes, self.kl.coef("reward"), self.normalizer)
                if self.probe is not None:  # the reference's log-probs on the probe, once (it is frozen)
                    self._retry_out_of_memory(Phase.EXPERIENCE, lambda: self.probe.measure_reference(
                        self.ref, self.memory.micro_batching(Phase.EXPERIENCE)["ref"]
                    ))  # fmt: skip
            if self.step == 0 and (report := offpolicy_report(config, metrics)):
                self.logger.event(0, "offpolicy", report)
            metrics |= experience_metrics(config, experience)
            # 4. critic update: clipped value loss on the returns
            updates = [self._update("critic", experience, timings)] if self.critic is not None else []
            # 5. actor update: clipped surrogate + β·KL − entropy bonus, once the critic has warmed up
            actor_updated = self.step >= config.trainer.critic_warmup
            if actor_updated:
                updates.append(self._update("actor", experience, timings))
            for update in updates:
                metrics |= update.metrics
                self.skipped_steps += update.skipped
            # the KL of the policy this update left, on the probe's fixed rows (with the actor's weights still in
            # place after its update; a critic warm-up leaves the policy, and the controllers read kl/mean)
            if self.probe is not None and actor_updated:
                with phase_timer(timings, "kl_probe"), profiling.phase("kl_probe"):
                    metrics |= self._retry_out_of_memory(Phase.EXPERIENCE, lambda: self.probe.measure(
                        self.actor, self.memory.micro_batching(Phase.EXPERIENCE)["actor"]
                    ))  # fmt: skip
                metrics["timing/kl_probe_s"] = timings["kl_probe"]
            self.offload.enter(Phase.BETWEEN_ITERATIONS)  # checkpoints, rollbacks, evaluation read weights, optimizers
            self.step += 1
            # 6. KL control: β for the next iteration from this one's KL — the update's own (`actor/ref_kl`), the
            #    experience's (`kl/mean`) or the probe's, as `algorithm.kl_ctrl.feedback` says — and
            #    `kl/tracking_error`
            metrics |= self.kl.step(metrics, config.data.train_batch_size)
            # 7. guards: back off, roll back, bump β or stop on grad-norm spikes, KL (of this update) or loss
            #    explosions, high KL, watched metrics and non-finite steps (out-of-memory errors are retried inside
            #    the phases); then the save before this iteration is good or passed over
            skipped = any(update.skipped for update in updates)
            actions = self.guards.observe(metrics, skipped, self.kl.guard_overrides)
            self._act(actions)
            self.keeper.judge(actions)
        # 8. metrics: counters, timings and throughput (MFU from the planner's FLOP count)
        return metrics | self._throughput(batch["lengths"], timings)

    def _built_roles(self) -> dict[str, RoleModel]:
        return {role: model for role in ROLES if (model := getattr(self, role)) is not None}

    def _throughput(self, lengths: torch.Tensor, timings: dict[str, float]) -> dict[str, float]:
        tokens, seconds = float(lengths.sum()), timings["iteration"]
        roles = self._built_roles()
        return {
            "train/skipped_steps": float(self.skipped_steps), "perf/step_time_s": seconds,
            "perf/tokens_per_s": tokens / seconds, **padding_metrics(list(roles.values())),
            **throughput_metrics(self.config, list(roles), lengths.cpu(), timings), **timing_metrics(timings),
        }  # fmt: skip

    def _update(self, role: str, experience: Experience, timings: dict[str, float]) -> RoleUpdate:
        """`ppo_epochs` passes of `role` over the mini-batches of `experience` (`Phase.update(role)`)."""
        role_config = getattr(self.config, role)
        make_loss = role_loss(role, self.config, self.models[role], self.kl.coef("loss") or 0.0, self.ref is not None)
        phase = Phase.update(role)
        with phase_timer(timings, phase.metric), profiling.phase(phase.metric):
            self.offload.enter(phase)
            # each mini-batch's forward-backward is retried on its own, before its optimizer step (memory_backoff.py)
            return update_role(
                role, self.models[role], self.optimizers[role], self.schedulers[role], experience,
                config=role_config, micro=lambda: self.memory.micro_batching(phase)[role], make_loss=make_loss,
                retry=partial(self._retry_out_of_memory, phase),
            )  # fmt: skip

    def _retry_out_of_memory(self, phase: Phase, attempt):
        """`attempt()`, run again with smaller micro-batches while any rank runs out of memory (`memory_backoff.py`)."""

        def free() -> None:
            for model in self._built_roles().values():  # the activations the layers still hold (models/failed_pass.py)
                release_failed_pass(model)
            for role, model in self.models.items():
                if self.offload.holds(role, "grads"):  # offloaded gradients hold no memory (and come back zeroed)
                    zero_grads(model, self.optimizers[role])

        def log(message: str) -> None:  # at the number of the iteration under way
            self.profiler.out_of_memory()
            self.logger.event(self.step + 1, "guard/out_of_memory", message)
            self.logger.log(self.step + 1, {"guard/out_of_memory": float(self.memory.retries)})

        return self.memory.run(phase, attempt, free, log)

    def _act(self, actions: list[GuardAction]) -> None:
        """Carry out what the guards asked for, each logged as a `guard/<guard>` event and scalar (the value that
        fired it) at the step it fired, also when an earlier action rolled the run back."""
        fired_at = self.step
        for action in actions:
            self.logger.event(fired_at, f"guard/{action.guard}", action.message)
            self.logger.log(fired_at, {f"guard/{action.guard}": action.value if math.isfinite(action.value) else 1.0})
            GUARD_ACTIONS[action.kind](self, action, fired_at)

    def _warn(self, action: GuardAction, fired_at: int) -> None:
        """A warning is its log line alone."""

    def _back_off(self, action: GuardAction, fired_at: int) -> None:
        for role in [action.role] if action.role else list(self.schedulers):
            self._scale_learning_rate(role, action.factor)

    def _bump_kl(self, action: GuardAction, fired_at: int) -> None:
        self.kl.scale(action.factor)

    def _stop(self, action: GuardAction, fired_at: int) -> None:
        """End the run on a guard's `stop`, the good checkpoint named in `latest`; `GuardStopped` carries the one
        message the command line prints."""
        message = f"guard/{action.guard} stopped the run: {action.message}; {self.keeper.leave_for_stop()}"
        self.logger.event(self.step, "stopped", message)
        raise GuardStopped(message)

    def _scale_learning_rate(self, role: str, factor: float) -> None:
        """`role`'s learning rate × `factor`, never below `guards.min_lr_fraction` × its configured rate."""
        floor = self.config.guards.min_lr_fraction * getattr(self.config, role).optim.lr
        applied = scale_learning_rate(self.schedulers[role], factor, floor)
        if applied != factor:
            self.logger.event(self.step, "guard/lr_floor", f"{role} learning rate held at guards.min_lr_fraction="
                              f"{self.config.guards.min_lr_fraction} of its configured rate")  # fmt: skip

    def _roll_back(self, action: GuardAction, fired_at: int) -> None:
        """Restore a checkpoint — the good one, or the best evaluation's (`CheckpointKeeper.rollback_target`) — with
        lower learning rates. The guards keep their own counters and the out-of-memory back-off its smaller
        micro-batches; an evaluation saved in a checkpoint passed over is forgotten with it (its best is the loaded
        one's)."""
        guards, target = self.guards, self.keeper.rollback_target(action.target)
        if target.path is None or guards.rollbacks >= action.max_rollbacks:
            reason = (
                "no good checkpoint to return to yet" if target.path is None else f"guards.max_rollbacks="
                f"{action.max_rollbacks} reached"
            )  # fmt: skip
            self.logger.event(fired_at, "guard/rollback", f"rollback not possible: {reason}; continuing")
            return
        counters, memory = guards.state_dict(), self.memory.state_dict()
        state, best_forgotten = self.keeper.roll_back_to(target.path, self.models, self.optimizers)
        self.load_trainer_state(state)
        guards.load_state_dict(counters)
        self.memory.load_state_dict(memory)
        if best_forgotten:
            guards.best_eval = state["guards"]["best_eval"]
            guards.evals_since_best = state["guards"]["evals_since_best"]
        guards.rollbacks += 1
        for role in self.schedulers:
            self._scale_learning_rate(role, action.factor)
        self.logger.event(fired_at, "guard/rollback", f"rolled back to {target.path}, learning rates × "
                          f"{action.factor}; the run continues from step {self.step}. Why this checkpoint: "
                          f"{target.why}")  # fmt: skip
        self.logger.log(fired_at, {"guard/rollback": float(guards.rollbacks)})

    # --- evaluation ----------------------------------------------------------------------------------------------
    def _describe_evaluation(self) -> None:
        guards, trainer = self.config.guards, self.config.trainer
        if self.evaluate is None:
            message = "no evaluation (no data.val_files)"
        else:
            message = self.evaluate.describe() + (
                f"; every {trainer.test_freq} steps" if trainer.test_freq else "; trainer.test_freq=0: never"
            )
        watched = guards.eval_drop_fraction is not None or guards.plateau_evaluations
        if watched and (self.evaluate is None or not self.evaluate.gives_reward or not trainer.test_freq):
            message += "; the evaluation-drop and plateau guards are off (no evaluated reward)"
        self.logger.event(0, "evaluation", message)

    def evaluation(self) -> dict[str, float]:
        """Evaluate the actor now: `eval/*` metrics, logged; the evaluation guards act on `eval/reward_mean`
        (a new best is saved as a checkpoint first, when the evaluation-drop guard may need to return to it)."""
        with profiling.phase("evaluation"):
            measured = self.evaluate(self.actor, self.ref)
        # the decoding's speed (`models.generation.Generation.metrics`) is logged as perf/, not as an evaluation
        speed = {key: measured.pop(key) for key in [k for k in measured if k.startswith("generation_")]}
        results = {f"eval/{k}": v for k, v in measured.items()}
        self.evaluations[self.step] = results
        self.logger.log(self.step, {**results, **{f"perf/eval_{k}": v for k, v in speed.items()}})
        if speed:
            self.logger.event(self.step, "evaluation", (
                f"{speed['generation_prompts']:.0f} prompts, {speed['generation_tokens']:.0f} tokens generated in "
                f"{speed['generation_s']:.2f} s ({speed['generation_tokens_per_s']:.0f} tokens/s)"))  # fmt: skip
        reward = results.get("eval/reward_mean")
        if reward is None:
            return results
        actions = self.guards.observe_evaluation(reward)
        new_best = self.guards.evals_since_best == 0 and self.guards.best_eval == reward
        if new_best and self.config.guards.eval_drop_fraction is not None and self.config.trainer.test_freq:
            self.keeper.best = str(self.save())
        self._act(actions)
        return results

    # --- the loop ------------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train to `total_steps`. On a preemption signal, save after the current iteration and raise `Preempted`;
        when this job's budget (`trainer.exit_interval`, `exit_duration_in_mins`) is spent, save and raise
        `JobBudgetReached`."""
        with watching() as watch, watch.in_the_loop():
            self._fit(watch, JobBudget(self.config.trainer.exit_interval, self.config.trainer.exit_duration_in_mins))
        return self.history

    def _fit(self, watch: PreemptionWatch, budget: JobBudget) -> None:
        trainer = self.config.trainer
        if self.step >= self.total_steps:
            self.logger.event(self.step, "finished", f"the run already reached its {self.total_steps} steps")
            return
        if self.evaluate is not None and trainer.val_before_train and self.step == 0:
            self.evaluation()
        while self.step < self.total_steps:
            number = self.step + 1  # logged under its own number, even when its guards rolled the run back
            self.profiler.begin(number)
            with profiling.phase(f"iteration {number}"):
                metrics = self.iteration()
            self.logger.log(number, metrics)
            self.history.append({"step": float(number), **metrics})
            self.keeper.poll()  # publish the pending save once every rank's write is done
            completed = self.step == number  # else a guard rolled the run back to a checkpoint: nothing new
            if completed and self.evaluate is not None and trainer.test_freq and self.step % trainer.test_freq == 0:
                self.history[-1] |= self.evaluation()
            if watch.agreed():
                path = self.save(wait=True)
                stop = watch.stop(str(path))
                if isinstance(stop, Interrupted):
                    self.logger.event(self.step, "interrupted", f"Ctrl-C; checkpoint {path}, exiting")
                    raise stop
                self.logger.event(self.step, "preempted", f"signal received; checkpoint {path}, exiting to requeue")
                mark_preempted()
                raise stop
            if self.step < self.total_steps and (reason := budget.reason(self.step)):
                path = self.save(wait=True)
                self.logger.event(self.step, "job budget", f"{reason}; checkpoint {path}, the next job resumes")
                raise JobBudgetReached(str(path))
            periodic = trainer.save_freq > 0 and self.step % trainer.save_freq == 0
            if self.step == number and periodic and self.step < self.total_steps:  # (an evaluation may roll back)
                self.save()
            self.profiler.end(number)  # the profiled range holds each iteration's evaluation and save too
        if trainer.save_freq >= 0:  # -1: never (verl), but for the preemption and job-budget saves above
            self.save()
        self.keeper.wait()  # the last save (or a pending one, such as a best evaluation's) is published

    def close(self) -> None:
        self.keeper.close()  # a save still pending is published if every rank can agree to (`CheckpointKeeper.close`)
        self.profiler.close()
        self.logger.close()


# What the trainer does for each kind of guard action (`guards.ActionKind`), besides logging it.
GUARD_ACTIONS: dict[ActionKind, Callable[[PPOTrainer, GuardAction, int], None]] = {
    "warn": PPOTrainer._warn,
    "lr_backoff": PPOTrainer._back_off,
    "kl_bump": PPOTrainer._bump_kl,
    "rollback": PPOTrainer._roll_back,
    "stop": PPOTrainer._stop,
}
