"""What watches an iteration without steering it, attached at set-up (`train/setup.py`) for the features that are on:
each observer has the iteration's three hooks — `after_experience` (the experience computed, in its phase),
`after_update` (the roles updated; the metrics it adds) and `iteration_ends` (the metrics it adds at the end) —
and does nothing at those it does not use."""

from __future__ import annotations

from typing import Any

import torch

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.models.widths import PaddingTally
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train import profiling
from megatron_ppo.train.kl_probe import KLProbe
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.phases import Phases
from megatron_ppo.train.roles import Roles
from megatron_ppo.train.run_state import RunState
from megatron_ppo.train.throughput import padding_metrics, phase_timer, throughput_metrics, timing_metrics


class Observer:
    def iteration_begins(self) -> None:
        """Before the iteration's batch is read."""

    def after_experience(self, step: int, metrics: dict[str, float]) -> None:
        """The experience and advantages of this iteration computed (inside its phase)."""

    def after_update(self, updated: list[str], timings: dict[str, float]) -> dict[str, float]:
        """`updated` roles updated; the metrics this observer adds."""
        return {}

    def iteration_ends(self, lengths: torch.Tensor, timings: dict[str, float]) -> dict[str, float]:
        """The iteration over (`lengths`: its rows' token counts); the metrics this observer adds."""
        return {}


class Observers(Observer):
    """The observers attached, each hook called on every one in turn."""

    def __init__(self, observers: list[Observer]) -> None:
        self.observers = observers

    def iteration_begins(self) -> None:
        for observer in self.observers:
            observer.iteration_begins()

    def after_experience(self, step: int, metrics: dict[str, float]) -> None:
        for observer in self.observers:
            observer.after_experience(step, metrics)

    def after_update(self, updated: list[str], timings: dict[str, float]) -> dict[str, float]:
        return {
            key: value for observer in self.observers for key, value in observer.after_update(updated, timings).items()
        }

    def iteration_ends(self, lengths: torch.Tensor, timings: dict[str, float]) -> dict[str, float]:
        return {key: value for o in self.observers for key, value in o.iteration_ends(lengths, timings).items()}


class KLProbeObserver(Observer):
    """`algorithm.kl_ctrl.feedback: probe` (`kl_probe.py`): the reference's log-probs on the probe's rows once (it is
    frozen), and after each actor update the KL of the policy it left (`kl/probe_*`, `timing/kl_probe_s`); a critic
    warm-up leaves the policy, and the controllers read `kl/mean` then."""

    def __init__(self, probe: KLProbe, roles: Roles, phases: Phases) -> None:
        self.probe, self.roles, self.phases = probe, roles, phases

    def _micro_batching(self, role: str) -> Any:
        return self.phases.memory.micro_batching(Phase.EXPERIENCE)[role]

    def after_experience(self, step: int, metrics: dict[str, float]) -> None:
        self.phases.retry(Phase.EXPERIENCE, lambda: self.probe.measure_reference(
            self.roles.ref, self._micro_batching("ref")))  # fmt: skip

    def after_update(self, updated: list[str], timings: dict[str, float]) -> dict[str, float]:
        if "actor" not in updated:
            return {}
        with phase_timer(timings, "kl_probe"), profiling.phase("kl_probe"):
            measured = self.phases.retry(Phase.EXPERIENCE, lambda: self.probe.measure(
                self.roles.actor, self._micro_batching("actor")))  # fmt: skip
        return {**measured, "timing/kl_probe_s": timings["kl_probe"]}


class OffPolicyReport(Observer):
    """At step 0, how far the data's behaviour policy is from the actor (`experience.offpolicy_report`)."""

    def __init__(self, config: PPOConfig, logger: MetricsLogger) -> None:
        self.config, self.logger = config, logger

    def after_experience(self, step: int, metrics: dict[str, float]) -> None:
        if step == 0 and (report := offpolicy_report(self.config, metrics)):
            self.logger.event(0, "offpolicy", report)


class Throughput(Observer):
    """Counters, timings and throughput (MFU from the planner's FLOP count) of each iteration."""

    def __init__(self, config: PPOConfig, roles: Roles, state: RunState) -> None:
        self.config, self.roles, self.state = config, roles, state

    def iteration_begins(self) -> None:
        for model in self.roles.built().values():
            model.padding = PaddingTally()  # perf/padded_over_real_tokens counts this iteration's passes

    def iteration_ends(self, lengths: torch.Tensor, timings: dict[str, float]) -> dict[str, float]:
        tokens, seconds = float(lengths.sum()), timings["iteration"]
        built = self.roles.built()
        return {
            "train/skipped_steps": float(self.state.skipped_steps), "perf/step_time_s": seconds,
            "perf/tokens_per_s": tokens / seconds, **padding_metrics(list(built.values())),
            **throughput_metrics(self.config, list(built), lengths.cpu(), timings), **timing_metrics(timings),
        }  # fmt: skip


def offpolicy_report(config: PPOConfig, metrics: dict[str, float]) -> str | None:
    """A line on how far the rows' behaviour policy is from the actor (the first batch's `rollout_corr/*`), a
    warning when the effective sample size, or the share of tokens whose ratio π/μ lies inside
    [1/threshold, threshold], is below `rollout_correction.min_eff_sample_size` (ESS alone misses a uniform shift:
    weights all near 0 are as even as weights all near 1); None without behaviour log-probs."""
    ess = metrics.get("rollout_corr/rollout_is_eff_sample_size")
    if ess is None:
        return None
    floor = config.algorithm.rollout_correction.min_eff_sample_size
    inside = (
        1.0
        - metrics["rollout_corr/rollout_is_ratio_fraction_high"]
        - metrics["rollout_corr/rollout_is_ratio_fraction_low"]
    )
    numbers = (f"ESS {ess:.3f} of the tokens, ratio inside the threshold band on {inside:.3f} of them, KL(μ‖π) "
               f"{metrics['rollout_corr/kl']:.4f} (k3 {metrics['rollout_corr/k3_kl']:.4f}), χ² token "
               f"{metrics['rollout_corr/chi2_token']:.3f} / sequence {metrics['rollout_corr/chi2_seq']:.3f}, "
               f"PPL actor {metrics['rollout_corr/training_ppl']:.3f} vs rows "
               f"{metrics['rollout_corr/rollout_ppl']:.3f}")  # fmt: skip
    if min(ess, inside) >= floor:
        return f"behaviour log-probs vs the actor at step 0: {numbers}"
    return (f"WARNING: the rows' behaviour policy is far from the actor at step 0 — {numbers}; below "
            f"algorithm.rollout_correction.min_eff_sample_size={floor}: the rows were not sampled from this actor "
            "(another checkpoint, or log-probs of another tokenisation?); consider rollout_correction.rollout_is / "
            "rollout_rs, or check model.init_checkpoint")  # fmt: skip
