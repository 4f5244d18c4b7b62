"""A run's set-up: the one place that reads the feature switches. It builds, in this order (the models' random
starts depend on it), the data order, the run's start (a run that may not start refuses before any model), the
logger, the roles (`train/roles.py`), the KL coefficients, the KL probe, the reward normaliser, the guards, the
out-of-memory back-off, the checkpoint keeper and the profiler; then the parts the trainer's loop calls, each
deciding for itself what to do (a part of a switched-off feature does nothing): the phases, the guard responses,
the saves, the stops, the evaluation plan and the iteration's observers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from megatron_ppo import algo
from megatron_ppo.checkpoint import directory
from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.checkpoint.run_start import RunStart, start_run
from megatron_ppo.checkpoint.shapes import checkpoint_problems, saved_dtype
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.data.rows import DataError, Row
from megatron_ppo.models.kernels import describe_kernels
from megatron_ppo.models.lora import describe_adapters
from megatron_ppo.parallel.collectives import global_rank
from megatron_ppo.train import profiling
from megatron_ppo.train.batch import EpochSampler, GroupSampler, build_sampler
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper
from megatron_ppo.train.evaluation import Evaluator
from megatron_ppo.train.evaluation_plan import EvaluationPlan
from megatron_ppo.train.guard_responses import GuardResponses
from megatron_ppo.train.guards import Guards
from megatron_ppo.train.kl_coefficients import KLCoefficients
from megatron_ppo.train.kl_probe import KLProbe
from megatron_ppo.train.memory_backoff import OutOfMemoryBackoff
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.observers import KLProbeObserver, Observer, Observers, OffPolicyReport, Throughput
from megatron_ppo.train.phases import Phases
from megatron_ppo.train.roles import Roles, build_roles
from megatron_ppo.train.run_state import RunState, Schedules
from megatron_ppo.train.saving import Saves, report_save
from megatron_ppo.train.stops import Stops


@dataclass
class Parts:
    total_steps: int
    run: RunStart
    logger: MetricsLogger
    state: RunState
    sampler: EpochSampler | GroupSampler
    roles: Roles
    kl: KLCoefficients
    probe: KLProbe | None
    normalizer: algo.RunningRewardNormalizer | None
    guards: Guards
    memory: OutOfMemoryBackoff
    keeper: CheckpointKeeper
    profiler: profiling.Profiler
    phases: Phases
    responses: GuardResponses
    saves: Saves
    stops: Stops
    evaluation: EvaluationPlan
    observers: Observers


def set_up(
    config: PPOConfig, rows: Sequence[Row], pad_id: int, evaluate: Evaluator | None, weights: InitialWeights | None
) -> Parts:
    """Every part of a run of `config` on `rows` (module docstring); `weights`: the checkpoints the models start
    from (chosen at the run's start, `train/run.py`), by default those the config names."""
    trainer = config.trainer
    sampler, sampled_rows, grouping = build_sampler(config, rows)
    batch = config.data.train_batch_size
    steps_per_epoch = sampled_rows // batch
    if steps_per_epoch == 0:
        drawn = "" if sampled_rows == len(rows) else f" ({sampled_rows} of the {len(rows)} read, in whole groups)"
        raise DataError(f"the data gives {sampled_rows} rows{drawn}, fewer than one batch of data.train_batch_size="
                        f"{batch}: set data.train_batch_size to at most {sampled_rows} (and the roles' "
                        "ppo_mini_batch_size to divide it), or give more rows (data.train_files)")  # fmt: skip
    total_steps = trainer.total_training_steps or steps_per_epoch * trainer.total_epochs
    run = start_run(config)  # before the models are built: a run that may not start refuses at once
    logger = MetricsLogger(run.log_dir, trainer.logger, total_steps, config=config, run_id=run.identity.run_id)
    state = RunState()  # the parts' reports below log at its step (closures over the logger and it: no cycle)
    weights = InitialWeights.of(config) if weights is None else weights
    refuse_mismatched_checkpoints(config, weights, run.resume_from)
    roles = build_roles(config, weights, total_steps, report=lambda line: logger.event(state.step, "offload", line))
    logger.event(0, "kernels", describe_kernels(config))
    if weights.actor and (saved := saved_dtype(directory.resolve(weights.actor), "actor")) != config.model.params_dtype:
        logger.event(0, "weights", f"{weights.actor} holds {saved} weights; this {config.model.params_dtype} run "
                     f"casts them (model.params_dtype), and their {saved} rounding stays")  # fmt: skip
    kl = KLCoefficients(config, total_steps)
    # the controllers' sensor with `kl_ctrl.feedback: probe`: KL after each update on fixed rows (kl_probe.py)
    probed = config.algorithm.kl_ctrl.feedback == "probe" and roles.ref is not None
    probe = KLProbe(config, rows, pad_id) if probed else None
    normalizer = algo.RunningRewardNormalizer() if config.reward.normalize else None
    guards = Guards(config.guards)
    memory = OutOfMemoryBackoff(config)
    keeper = CheckpointKeeper(trainer, run.identity, report=partial(report_save, logger))
    state.attach({"sampler": sampler, "kl": kl, "schedulers": Schedules(roles.schedulers), "normalizer": normalizer,
                  "guards": guards, "memory": memory}, keeper)  # fmt: skip
    profiler = profiling.Profiler(config.profiling, run.log_dir, global_rank(),
                                  say=lambda line: logger.event(state.step, "profiling", line))  # fmt: skip
    phases = Phases(config, roles, kl, memory, state, logger, profiler)
    responses = GuardResponses(config, roles, state, guards, kl, keeper, logger)
    saves = Saves(trainer, roles, state, keeper, logger)
    evaluation = EvaluationPlan(config, evaluate, roles, state, guards, responses, saves, logger)
    watchers: list[Observer] = [KLProbeObserver(probe, roles, phases)] if probe is not None else []
    observers = Observers([*watchers, OffPolicyReport(config, logger), Throughput(config, roles, state)])
    logger.event(0, "run", f"{trainer.project_name}/{trainer.experiment_name}")
    if roles.critic_source is not None:
        logger.event(0, "critic", roles.critic_source)
    for role, model in roles.models.items():
        if (lora := getattr(config, role).lora).enabled:
            logger.event(0, "lora", describe_adapters(role, model.chunks, lora))
    if grouping:
        logger.event(0, "data", grouping)
    logger.event(0, "evaluation", evaluation.describe())
    return Parts(total_steps, run, logger, state, sampler, roles, kl, probe, normalizer, guards, memory, keeper,
                 profiler, phases, responses, saves, Stops(trainer, saves, state, logger, total_steps), evaluation,
                 observers)  # fmt: skip


def refuse_mismatched_checkpoints(config: PPOConfig, weights: InitialWeights, resume_from: Path | None) -> None:
    """Every `model.*` setting the checkpoints the models will load disagree with (`checkpoint/shapes.py`): the
    initial weights (the actor's, the critic's own) and the checkpoint a resume loads, each role they hold; one
    `ConfigError` naming them all, before any model is built."""
    paths = dict.fromkeys(p for p in (weights.actor, weights.critic, resume_from) if p is not None)
    problems = [problem for path in paths for problem in checkpoint_problems(directory.resolve(path), config)]
    if problems:
        raise ConfigError(problems)
