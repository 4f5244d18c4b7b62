"""The KL coefficients of a run, built from the config: one controller per enabled KL term."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ppo.algo import KLController, KLStage, StagedKLSchedule, build_kl_controller
from megatron_ppo.config import ConfigError, PPOConfig
from megatron_ppo.train.guards import EXPERIENCE_KL, PROBE_KL, PROBE_PREFIX, UPDATE_KL

KLCoefficient = KLController | StagedKLSchedule
# What `KLCoefficients.step` logs: β of each term, the stage index and the target (the controller's, not a measured
# KL), and how far the measured KL was from that target
COEF_METRICS = {"loss": "kl/coef", "reward": "kl/reward_coef"}
STAGE_METRIC, TARGET_METRIC, TRACKING_METRIC = "kl/stage", "kl/target", "kl/tracking_error"
# the KL the controllers read, by `algorithm.kl_ctrl.feedback`
EXPERIENCE_STDERR = "kl/stderr"  # the standard error of the batch's `kl/mean` (train/experience.py)
FEEDBACK_METRICS = {"experience": EXPERIENCE_KL, "update": UPDATE_KL, "probe": PROBE_KL}


def tracked_prefix_of(feedback: str) -> str:
    """The KL whose tracking of the targets is judged under `feedback` (`<prefix>mean`, with `<prefix>stderr`): the
    probe's when the controllers read it, else the batch's `kl/mean` (the update's own KL is an average along the
    update, not the policy it leaves)."""
    return PROBE_PREFIX if feedback == "probe" else EXPERIENCE_KL.removesuffix("mean")


def tracked_kl_prefix(config: PPOConfig) -> str:
    """`tracked_prefix_of` the config's `algorithm.kl_ctrl.feedback`."""
    return tracked_prefix_of(config.algorithm.kl_ctrl.feedback)


TRACKING_BAND = 0.1  # a step tracks its target when |KL/target − 1| ≤ this
SETTLING_STEPS = 2  # the steps at the start of each stage not judged (the controller is still reaching the target)


def tracking_error(kl: float, target: float) -> float:
    """|KL/target − 1|: 0.1 is the edge of the ±10 % band."""
    return abs(kl / target - 1.0)


def chance_within_band(relative_stderr: float) -> float:
    """P(|KL/target − 1| ≤ TRACKING_BAND) of a measured KL whose true value is exactly the target, the measurement
    normal with standard error `relative_stderr`·target: erf(band / (relative_stderr·√2))."""
    return math.erf(TRACKING_BAND / (relative_stderr * math.sqrt(2))) if relative_stderr > 0 else 1.0


@dataclass(frozen=True)
class KLTracking:
    """How a run's KL followed its targets: `hits` of the `judged` steps within ±TRACKING_BAND (every step with a
    target but the first SETTLING_STEPS of its stage), their mean |KL/target − 1|, the largest KL/target of any
    step with a target, and `noise_hits`: the judged steps a KL held exactly on target would have measured within
    the band, given each step's own measurement noise (Σ `chance_within_band` of kl/stderr ÷ kl/mean; NaN where
    the noise was not logged) — the share no controller can beat, since it comes from which rows the batch drew."""

    hits: int
    judged: int
    mean_error: float
    max_ratio: float
    noise_hits: float = math.nan

    @property
    def within(self) -> float:
        return self.hits / self.judged if self.judged else math.nan

    @property
    def noise_ceiling(self) -> float:
        return self.noise_hits / self.judged if self.judged else math.nan


def kl_tracking(
    kl: Mapping[int, float],
    targets: Mapping[int, float | None],
    stages: Mapping[int, int],
    stderr: Mapping[int, float] | None = None,
) -> KLTracking:
    """`KLTracking` of the KL per step `kl` against `targets` (None: no target, as in a warm-up), each step in the
    stage `stages` gives it; `stderr`: each step's standard error of `kl` (kl/stderr), for `noise_hits`."""
    targeted = sorted(n for n in kl if targets.get(n) is not None)
    first = {}
    for n in targeted:
        first.setdefault(stages[n], n)
    judged = [n for n in targeted if n >= first[stages[n]] + SETTLING_STEPS]
    errors = [tracking_error(kl[n], targets[n]) for n in judged]
    noisy = stderr is not None and all(n in stderr and kl[n] > 0 for n in judged)
    return KLTracking(
        hits=sum(e <= TRACKING_BAND for e in errors),
        judged=len(judged),
        mean_error=sum(errors) / len(errors) if errors else math.nan,
        max_ratio=max((kl[n] / targets[n] for n in targeted), default=math.nan),
        noise_hits=sum(chance_within_band(stderr[n] / kl[n]) for n in judged) if noisy else math.nan,
    )


def logged_kl(history: Sequence[Mapping[str, float]], prefix: str) -> tuple[dict[int, float], dict[int, float] | None]:
    """The KL `<prefix>mean` a run logged, by step, and the standard errors its noise share reads: the batch's
    `kl/stderr` for `kl/`, None for the probe (its rows are the same every step, so its standard error is a constant
    offset, not noise between steps)."""
    kl = {int(h["step"]): h[f"{prefix}mean"] for h in history if f"{prefix}mean" in h}
    if prefix != tracked_prefix_of("experience"):
        return kl, None
    return kl, {int(h["step"]): h[EXPERIENCE_STDERR] for h in history if EXPERIENCE_STDERR in h}


def logged_tracking(history: Sequence[Mapping[str, float]], prefix: str) -> KLTracking | None:
    """`kl_tracking` of the KL `<prefix>mean` a run logged (`logged_kl`) against the targets and stages it logged
    beside it; None without such steps."""
    kl, stderr = logged_kl(history, prefix)
    targeted = {int(h["step"]): h for h in history if TARGET_METRIC in h and int(h["step"]) in kl}
    if not targeted:
        return None
    return kl_tracking({n: kl[n] for n in targeted}, {n: h[TARGET_METRIC] for n, h in targeted.items()},
                       {n: int(h.get(STAGE_METRIC, 0.0)) for n, h in targeted.items()}, stderr)  # fmt: skip


def build_kl_coefficients(config: PPOConfig, total_steps: int) -> dict[str, KLCoefficient]:
    """β for each enabled KL term: "loss" (starts at actor.kl_loss_coef) and/or "reward" (algorithm.kl_ctrl.kl_coef).

    Terms listed in `algorithm.kl_ctrl.apply_to` follow `kl_ctrl.type`; other enabled terms keep a fixed β
    (which is verl's behaviour for the KL loss).
    """
    kl_ctrl = config.algorithm.kl_ctrl
    starts = {}
    if config.actor.use_kl_loss:
        starts["loss"] = config.actor.kl_loss_coef
    if config.algorithm.use_kl_in_reward:
        starts["reward"] = kl_ctrl.kl_coef
    bounds = {"min_coef": kl_ctrl.min_coef, "max_coef": kl_ctrl.max_coef}
    coefficients: dict[str, KLCoefficient] = {}
    for term, start in starts.items():
        kind = kl_ctrl.type if term in kl_ctrl.apply_to else "fixed"
        if kind == "staged":
            stages = [
                KLStage(
                    name=s.name,
                    end=s.end,
                    controller=s.controller,
                    target_kl=s.target_kl,
                    band=tuple(s.band) if s.band else None,
                    horizon=s.horizon,
                    alpha=s.alpha,
                    kp=s.kp,
                    ki=s.ki,
                    rate_limit=s.rate_limit,
                    guards=dict(s.guards),
                )
                for s in kl_ctrl.stages
            ]
            coefficients[term] = StagedKLSchedule(stages, total_steps, start, unit=kl_ctrl.stage_unit, **bounds)
        elif kind == "fixed":
            coefficients[term] = build_kl_controller("fixed", start)
        else:
            coefficients[term] = build_kl_controller(
                kind,
                start,
                target_kl=kl_ctrl.target_kl,
                horizon=kl_ctrl.horizon,
                alpha=kl_ctrl.alpha,
                band=tuple(kl_ctrl.band) if kl_ctrl.band else None,
                kp=kl_ctrl.kp,
                ki=kl_ctrl.ki,
                rate_limit=kl_ctrl.rate_limit,
                **bounds,
            )
    return coefficients


class KLCoefficients:
    """β of each enabled KL term ("loss", "reward"), stepped together from the KL measured in each iteration."""

    def __init__(self, config: PPOConfig, total_steps: int) -> None:
        self.controllers = build_kl_coefficients(config, total_steps)
        self.feedback = FEEDBACK_METRICS[config.algorithm.kl_ctrl.feedback]
        self.tracked = tracked_kl_prefix(config) + "mean"

    def coef(self, term: str) -> float | None:
        """β of `term` for the next update; None when that KL term is off."""
        controller = self.controllers.get(term)
        return None if controller is None else controller.value

    @property
    def guard_overrides(self) -> dict[str, float]:
        """Guard thresholds set by the current KL stage (empty unless a term is staged)."""
        return {k: v for c in self.controllers.values() for k, v in c.guard_overrides.items()}

    def step(self, metrics: Mapping[str, float], batch_rows: int) -> dict[str, float]:
        """Log the β used in this iteration (with its target, stage and `kl/tracking_error`, the tracked KL — the
        probe's, else the experience's `kl/mean` — against that target), then update every controller from the KL of
        `kl_ctrl.feedback` (per token; the experience KL where the update's is missing, as in a critic warm-up; no
        update when neither was measured or it is not finite)."""
        measured = metrics.get(self.tracked)
        current_kl = metrics.get(self.feedback, metrics.get(EXPERIENCE_KL))
        out: dict[str, float] = {}
        for term, controller in self.controllers.items():
            out[COEF_METRICS[term]] = controller.value
            if controller.stage_index is not None:
                out[STAGE_METRIC] = float(controller.stage_index)
            if controller.target_kl is not None:
                out[TARGET_METRIC] = controller.target_kl
                if measured is not None and math.isfinite(measured):
                    out[TRACKING_METRIC] = tracking_error(measured, controller.target_kl)
            if current_kl is not None and math.isfinite(current_kl):
                controller.update(current_kl, n_steps=batch_rows)
        return out

    def scale(self, factor: float) -> None:
        """Every active β × `factor`, within each controller's clamps (the KL-bump guard)."""
        for controller in self.controllers.values():
            controller.scale(factor)

    def state_dict(self) -> dict[str, Any]:
        return {term: c.state_dict() for term, c in self.controllers.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's controllers; one saved with other KL stages (stage ends are fractions of the run's length,
        so a changed trainer.total_training_steps or total_epochs moves them) is a `ConfigError` naming the keys."""
        for term, controller in self.controllers.items():
            try:
                controller.load_state_dict(state[term])
            except ValueError as differs:
                raise ConfigError(
                    [
                        f"{differs} (KL term {term!r}); the stages' ends are fractions of the run's length, so a "
                        "changed trainer.total_training_steps (or trainer.total_epochs, data.train_batch_size) or "
                        "algorithm.kl_ctrl.stages moves them: resume with the values the run started with (the "
                        "checkpoint's run.json lists them), or start a new run (trainer.resume_mode=disable)"
                    ]
                ) from None
