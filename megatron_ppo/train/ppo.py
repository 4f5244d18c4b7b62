"""The offline PPO loop: read rows → experience → advantages → critic/actor updates → KL control, guards,
metrics, checkpoints (`docs/design.md`, "One PPO iteration"; `PPOTrainer.iteration` numbers the steps).

Set-up (`train/setup.py`) reads the feature switches once and hands the trainer its parts, each deciding for itself:
the phases (`phases.py`: timers, offload, out-of-memory retries, which roles update), the iteration's observers
(`observers.py`: the KL probe, the off-policy report, throughput), the guard responses (`guard_responses.py`), the
saves (`saving.py`), the stops (`stops.py`: preemption, the job's budget) and the evaluation plan
(`evaluation_plan.py`); what a checkpoint holds of the run is the `RunState` (`run_state.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.data.prepared import rows_at
from megatron_ppo.data.rows import Row
from megatron_ppo.models.gpt import RoleModel
from megatron_ppo.models.offload import HostOffload
from megatron_ppo.parallel.device import current_device, to_device
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train import profiling
from megatron_ppo.train.batch import collate
from megatron_ppo.train.evaluation import Evaluator
from megatron_ppo.train.experience import compute_advantages, experience_metrics
from megatron_ppo.train.guards import GuardAction
from megatron_ppo.train.setup import set_up
from megatron_ppo.train.throughput import phase_timer


class PPOTrainer:
    """A run: its parts (`train/setup.py`), the iteration and the loop."""

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
        self.config, self.rows, self.pad_id = config, rows, pad_id
        parts = set_up(config, rows, pad_id, evaluate, weights)
        self.total_steps, self.run, self.logger, self.state = parts.total_steps, parts.run, parts.logger, parts.state
        self.sampler, self.roles, self.kl, self.probe = parts.sampler, parts.roles, parts.kl, parts.probe
        self.normalizer, self.guards, self.memory = parts.normalizer, parts.guards, parts.memory
        self.keeper, self.profiler, self.phases = parts.keeper, parts.profiler, parts.phases
        self.responses, self.saves, self.stops = parts.responses, parts.saves, parts.stops
        self.evaluation_plan, self.observers = parts.evaluation, parts.observers
        self.history: list[dict[str, float]] = []

    # --- one iteration -------------------------------------------------------------------------------------------
    def iteration(self) -> dict[str, float]:
        """One PPO iteration, in the order of the algorithm; returns its metrics."""
        config, state, phases, timings = self.config, self.state, self.phases, {}
        self.observers.iteration_begins()
        with phase_timer(timings, "iteration"):
            # 1. batch: the next train_batch_size rows, tokenized, right-padded and on the run's device
            rows = rows_at(self.rows, self.sampler.next_batch(config.data.train_batch_size))
            batch = to_device(collate(rows, self.pad_id), current_device(), "the PPO batch")
            with phases.running(Phase.EXPERIENCE, timings):
                # 2. experience: log-probs of actor and reference, values of the critic (no grad; on every rank)
                passes = phases.experience(batch)
                # 3. advantages: token rewards (clipped score, minus β·KL when the KL is in the reward), GAE or GRPO
                experience, metrics = compute_advantages(config, batch, passes, self.kl.coef("reward"), self.normalizer)
                self.observers.after_experience(state.step, metrics)
            metrics |= experience_metrics(config, experience)
            # 4.–5. critic update (clipped value loss on the returns), then actor update (clipped surrogate + β·KL −
            #    entropy bonus) once the critic has warmed up
            updated = phases.roles_to_update(state.step)
            updates = [phases.update(role, experience, timings) for role in updated]
            for update in updates:
                metrics |= update.metrics
                state.skipped_steps += update.skipped
            metrics |= self.observers.after_update(updated, timings)  # the KL probe: the policy the update left
            phases.between_iterations()
            state.step += 1
            # 6. KL control: β for the next iteration from this one's KL — the update's own (`actor/ref_kl`), the
            #    experience's (`kl/mean`) or the probe's, as `algorithm.kl_ctrl.feedback` says — and
            #    `kl/tracking_error`
            metrics |= self.kl.step(metrics, config.data.train_batch_size)
            # 7. guards: back off, roll back, bump β or stop on grad-norm spikes, KL (of this update) or loss
            #    explosions, high KL, watched metrics and non-finite steps (out-of-memory errors are retried inside
            #    the phases); then the save before this iteration is good or passed over
            actions = self.guards.observe(metrics, any(u.skipped for u in updates), self.kl.guard_overrides)
            self.respond(actions)
            self.keeper.judge(state.step, actions)
        # 8. metrics: counters, timings and throughput (MFU from the planner's FLOP count)
        return metrics | self.observers.iteration_ends(batch["lengths"], timings)

    # --- the loop ------------------------------------------------------------------------------------------------
    def fit(self) -> list[dict[str, float]]:
        """Train to `total_steps`. On a preemption signal, save after the current iteration and raise `Preempted`;
        when this job's budget (`trainer.exit_interval`, `exit_duration_in_mins`) is spent, save and raise
        `JobBudgetReached`."""
        if self.state.step >= self.total_steps:
            self.logger.event(self.state.step, "finished", f"the run already reached its {self.total_steps} steps")
            return self.history
        with self.stops.watching():
            self.evaluation_plan.before_training()
            while self.state.step < self.total_steps:
                number = self.state.step + 1  # logged under its own number, even when its guards rolled the run back
                self.profiler.begin(number)
                with profiling.phase(f"iteration {number}"):
                    metrics = self.iteration()
                self.logger.log(number, metrics)
                self.history.append({"step": float(number), **metrics})
                self.keeper.poll()  # publish the pending save once every rank's write is done
                self.history[-1] |= self.evaluation_plan.if_due(completed=self.state.step == number)
                self.stops.check()
                self.saves.if_due(number, self.total_steps)
                self.profiler.end(number)  # the profiled range holds each iteration's evaluation and save too
            self.saves.final()
        return self.history

    # --- what callers use ----------------------------------------------------------------------------------------
    def respond(self, actions: list[GuardAction]) -> None:
        """Carry out what the guards asked for (`guard_responses.py`)."""
        self.responses.respond(actions)

    def evaluation(self) -> dict[str, float]:
        """Evaluate the actor now (`evaluation_plan.py`)."""
        return self.evaluation_plan.run()

    def save(self, wait: bool = False) -> Path:
        """Checkpoint this step; `wait`: published before this returns."""
        return self.saves.save(wait)

    def resume(self) -> Path | None:
        """Load the checkpoint `start_run` chose (None: a new run), and log what the start decided."""
        path = self.run.resume_from
        if path is not None:
            self.state.load_state_dict(self.keeper.resume(path, self.roles.models, self.roles.optimizers))
        if self.run.name_in_latest is not None:  # only now that it has loaded
            self.keeper.name_in_latest(self.run.name_in_latest)
        for message in self.run.messages:
            self.logger.event(self.state.step, "run", message)
        return path

    def trainer_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the run (`run_state.py`)."""
        return self.state.state_dict()

    def close(self) -> None:
        self.keeper.close()  # a save still pending is published if every rank can agree to (`CheckpointKeeper.close`)
        self.profiler.close()
        self.logger.close()

    @property
    def step(self) -> int:
        return self.state.step

    @property
    def skipped_steps(self) -> int:
        return self.state.skipped_steps

    @property
    def evaluations(self) -> dict[int, dict[str, float]]:
        return self.state.evaluations

    @property
    def actor(self) -> RoleModel:
        return self.roles.actor

    @property
    def ref(self) -> RoleModel | None:
        return self.roles.ref

    @property
    def critic(self) -> RoleModel | None:
        return self.roles.critic

    @property
    def models(self) -> dict[str, RoleModel]:
        return self.roles.models

    @property
    def optimizers(self) -> dict[str, Any]:
        return self.roles.optimizers

    @property
    def schedulers(self) -> dict[str, Any]:
        return self.roles.schedulers

    @property
    def offload(self) -> HostOffload:
        return self.roles.offload
