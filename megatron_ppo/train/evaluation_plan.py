"""When the run evaluates the actor, and what an evaluation does besides scoring: before training
(`trainer.val_before_train`, a new run), every `trainer.test_freq` steps after an iteration that completed (not one
a guard rolled back), logged as `eval/*` and the decoding's speed as `perf/eval_*`; the evaluation guards act on
`eval/reward_mean` (a new best is saved first, when the evaluation-drop guard may need to return to it). Without an
evaluator (no `data.val_files`, no task) it does nothing but say so."""

from __future__ import annotations

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.train import profiling
from megatron_ppo.train.evaluation import Evaluator
from megatron_ppo.train.guard_responses import GuardResponses
from megatron_ppo.train.guards import Guards
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.roles import Roles
from megatron_ppo.train.run_state import RunState
from megatron_ppo.train.saving import Saves


class EvaluationPlan:
    def __init__(self, config: PPOConfig, evaluate: Evaluator | None, roles: Roles, state: RunState, guards: Guards,
                 responses: GuardResponses, saves: Saves, logger: MetricsLogger) -> None:  # fmt: skip
        self.config, self.evaluate, self.roles, self.state = config, evaluate, roles, state
        self.guards, self.responses, self.saves, self.logger = guards, responses, saves, logger
        trainer = config.trainer
        self.test_freq = trainer.test_freq if evaluate is not None else 0
        self.first = evaluate is not None and trainer.val_before_train

    def describe(self) -> str:
        """What is evaluated when, and whether the evaluation guards can act (logged at the run's start)."""
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
        return message

    def before_training(self) -> None:
        if self.first and self.state.step == 0:
            self.run()

    def if_due(self, completed: bool) -> dict[str, float]:
        """After an iteration: the evaluation's metrics when one is due (`completed`: not rolled back), else none."""
        if completed and self.test_freq and self.state.step % self.test_freq == 0:
            return self.run()
        return {}

    def run(self) -> dict[str, float]:
        """Evaluate the actor now (module docstring)."""
        assert self.evaluate is not None, "no evaluator: nothing to evaluate"
        step = self.state.step
        with profiling.phase("evaluation"):
            measured = self.evaluate(self.roles.actor, self.roles.ref)
        # the decoding's speed (`models.generation.Generation.metrics`) is logged as perf/, not as an evaluation
        speed = {key: measured.pop(key) for key in [k for k in measured if k.startswith("generation_")]}
        results = {f"eval/{k}": v for k, v in measured.items()}
        self.state.evaluations[step] = results
        self.logger.log(step, {**results, **{f"perf/eval_{k}": v for k, v in speed.items()}})
        if speed:
            self.logger.event(step, "evaluation", (
                f"{speed['generation_prompts']:.0f} prompts, {speed['generation_tokens']:.0f} tokens generated in "
                f"{speed['generation_s']:.2f} s ({speed['generation_tokens_per_s']:.0f} tokens/s)"))  # fmt: skip
        reward = results.get("eval/reward_mean")
        if reward is None:
            return results
        actions = self.guards.observe_evaluation(reward)
        new_best = self.guards.evals_since_best == 0 and self.guards.best_eval == reward
        if new_best and self.config.guards.eval_drop_fraction is not None and self.config.trainer.test_freq:
            self.saves.keeper.best = str(self.saves.save())
        self.responses.respond(actions)
        return results
