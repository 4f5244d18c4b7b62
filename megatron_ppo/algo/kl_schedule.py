"""Staged KL thresholds: the KL coefficient is steered by a different rule in each phase of training.

Progress is split into ordered, named stages; stage i covers steps [end_{i−1}, end_i), with `end` given as a
fraction of the total steps (`unit="fraction"`) or as a step number (`unit="step"`); the last stage also covers
any step past the planned end. In a run too short for every stage to get a step (fractions rounded to steps), a
stage of zero steps is skipped. A stage's `controller` is one of

    warmup     the KL term is off at the first step and β ramps linearly to `kl_coef` at the stage's end:
               β_t = kl_coef · (t − start)/(end − start)   (only the first stage may be a warm-up)
    fixed | adaptive | power_law | band | pi
               the rule of that `KLController`, with the stage's target/band/gains, applied to the current β
               (the PI rule also reads the KL measured at the step before, in whichever stage that was)

β is continuous across stage boundaries: a new stage starts from the β the previous one left (after a warm-up:
exactly `kl_coef`, where the ramp ends). Outside the warm-up β stays within [min_coef, max_coef]. A stage may
also carry guard thresholds (e.g. a tighter KL-explosion limit late in training), exposed as `guard_overrides`.
The schedule is a pure function of (config, step, β, the previous step's KL), so `state_dict()` restores it
exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ppo.algo.kl_control import build_kl_controller

WARMUP = "warmup"


@dataclass(frozen=True)
class KLStage:
    """One phase of the schedule; `end` in the schedule's unit (fraction of the run, or step number)."""

    name: str
    end: float
    controller: str = "power_law"
    target_kl: float | None = None
    band: tuple[float, float] | None = None
    horizon: float = 10000.0
    alpha: float = 1.5
    kp: float = 1.0
    ki: float = 0.5
    rate_limit: float = 2.0
    guards: Mapping[str, float] = field(default_factory=dict)


class StagedKLSchedule:
    """A KL controller whose rule changes with training progress; same interface as `KLController`."""

    kind = "staged"

    def __init__(
        self,
        stages: Sequence[KLStage],
        total_steps: int,
        kl_coef: float,
        *,
        unit: str = "fraction",
        min_coef: float = 0.0,
        max_coef: float = math.inf,
    ) -> None:
        if not stages:
            raise ValueError("a staged KL schedule needs at least one stage")
        if unit not in ("fraction", "step"):
            raise ValueError(f"stage unit must be 'fraction' or 'step', got {unit!r}")
        if any(stage.controller == WARMUP for stage in stages[1:]):
            raise ValueError("only the first KL stage may be a warm-up (a later ramp from 0 would break continuity)")
        self.stages = list(stages)
        self.total_steps = total_steps
        self.kl_coef, self.min_coef, self.max_coef = kl_coef, min_coef, max_coef
        self.stage_ends = [round(s.end * total_steps) if unit == "fraction" else int(s.end) for s in stages]
        if any(b < a for a, b in zip(self.stage_ends, self.stage_ends[1:], strict=False)):
            raise ValueError(f"KL stage ends must not decrease, got steps {self.stage_ends}")
        self.step = 0
        self.previous_kl: float | None = None  # the KL of the last update (the PI rule's proportional term)
        self.value = self._ramp(0) if self._is_warmup(0) else self._clamp(kl_coef)

    @property
    def stage_index(self) -> int:
        return self.stage_index_at(self.step)

    @property
    def stage(self) -> KLStage:
        return self.stages[self.stage_index]

    @property
    def target_kl(self) -> float | None:
        """The current stage's target (None in a warm-up stage)."""
        return self.stage.target_kl

    @property
    def guard_overrides(self) -> dict[str, float]:
        """Guard thresholds set by the current stage (empty where it sets none)."""
        return dict(self.stage.guards)

    def stage_index_at(self, step: int) -> int:
        """Index of the stage that owns `step` (the last stage past the end)."""
        for index, end in enumerate(self.stage_ends):
            if step < end:
                return index
        return len(self.stages) - 1

    def stage_start(self, index: int) -> int:
        return self.stage_ends[index - 1] if index > 0 else 0

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Advance one training step given the KL measured in it; returns β for the next step."""
        if not math.isfinite(current_kl):
            raise ValueError(f"KL schedule got a non-finite KL ({current_kl}); the step should have been skipped")
        was_warmup = self._is_warmup(self.step)
        self.step += 1
        stage = self.stage
        if stage.controller == WARMUP:
            self.value = self._ramp(self.step)
        elif was_warmup:
            self.value = self._clamp(self.kl_coef)
        else:
            controller = build_kl_controller(
                stage.controller,
                self.value,
                target_kl=stage.target_kl,
                horizon=stage.horizon,
                alpha=stage.alpha,
                band=stage.band,
                kp=stage.kp,
                ki=stage.ki,
                rate_limit=stage.rate_limit,
                previous_kl=self.previous_kl,
                min_coef=self.min_coef,
                max_coef=self.max_coef,
            )
            self.value = controller.update(current_kl, n_steps)
        self.previous_kl = float(current_kl)
        return self.value

    def scale(self, factor: float) -> None:
        """β ← clamp(β·factor) (a guard's correction) outside warm-up; during warm-up the KL term is ramping in by
        design and β is left to the ramp."""
        if not self._is_warmup(self.step):
            self.value = self._clamp(self.value * factor)

    def state_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "value": self.value,
            "previous_kl": self.previous_kl,
            "stage_names": [s.name for s in self.stages],
            "stage_ends": list(self.stage_ends),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise ValueError(f"checkpoint holds a {state.get('kind')!r} KL controller, the config builds 'staged'")
        saved = (list(state["stage_names"]), list(state["stage_ends"]))
        if saved != ([s.name for s in self.stages], self.stage_ends):
            raise ValueError(
                f"checkpoint KL stages {saved} differ from the config's "
                f"{([s.name for s in self.stages], self.stage_ends)}; resume with the schedule the run started with"
            )
        self.step, self.value = int(state["step"]), float(state["value"])
        self.previous_kl = state.get("previous_kl")  # absent from checkpoints written before the PI rule

    def _is_warmup(self, step: int) -> bool:
        return self.stages[self.stage_index_at(step)].controller == WARMUP

    def _ramp(self, step: int) -> float:
        index = self.stage_index_at(step)
        start, end = self.stage_start(index), self.stage_ends[index]
        return self.kl_coef * (step - start) / (end - start)

    def _clamp(self, value: float) -> float:
        return min(max(value, self.min_coef), self.max_coef)
