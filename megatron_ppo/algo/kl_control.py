"""KL-coefficient controllers: β for the KL loss, the KL-in-reward penalty, or both.

Every controller has `value` (β for the next step), `update(current_kl, n_steps)`, `state_dict()` and
`load_state_dict()`, and keeps β within [min_coef, max_coef]. Plain attributes say what it aims at: `target_kl`
(None where it has no target), `stage_index` (None unless staged) and `guard_overrides` (guard thresholds set by the
current stage; empty unless staged). A β that reaches 0 can never grow again under a
multiplicative rule, so a positive `min_coef` keeps a controller alive.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_ppo.algo.registry import registrar


class KLController:
    """Base: a coefficient clamped to [min_coef, max_coef]; subclasses define `_next(kl, n_steps)`."""

    kind = "base"
    target_kl: float | None = None
    stage_index: int | None = None

    def __init__(self, kl_coef: float, min_coef: float = 0.0, max_coef: float = math.inf) -> None:
        if not 0.0 <= min_coef <= max_coef:
            raise ValueError(f"need 0 ≤ min_coef ≤ max_coef, got min_coef={min_coef}, max_coef={max_coef}")
        self.min_coef, self.max_coef = min_coef, max_coef
        self.value = self._clamp(kl_coef)

    @property
    def guard_overrides(self) -> dict[str, float]:
        return {}

    def _clamp(self, value: float) -> float:
        return min(max(value, self.min_coef), self.max_coef)

    def _next(self, current_kl: float, n_steps: int) -> float:
        raise NotImplementedError

    def update(self, current_kl: float, n_steps: int = 1) -> float:
        """Set β from the KL measured at the last step; returns the new β."""
        if not math.isfinite(current_kl):
            raise ValueError(f"KL controller got a non-finite KL ({current_kl}); the step should have been skipped")
        self.value = self._clamp(self._next(float(current_kl), n_steps))
        return self.value

    def scale(self, factor: float) -> None:
        """β ← clamp(β·factor): an outside correction (a guard), after which the rule continues from the new β."""
        self.value = self._clamp(self.value * factor)

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self.kind:
            raise ValueError(f"checkpoint holds a {state['kind']!r} KL controller, the config builds {self.kind!r}")
        self.value = float(state["value"])


class FixedKLController(KLController):
    """β stays where it is."""

    kind = "fixed"

    def _next(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController(KLController):
    """Ziegler et al. (2019): e = clip(KL/target − 1, −0.2, 0.2),  β ← β·(1 + e·n_steps/horizon).

    The trajectory equals verl's `AdaptiveKLController` (n_steps there is the batch size)."""

    kind = "adaptive"

    def __init__(self, kl_coef: float, target_kl: float, horizon: float, **bounds: float) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        super().__init__(kl_coef, **bounds)
        self.target_kl, self.horizon = target_kl, horizon

    def _next(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        return self.value * (1.0 + error * n_steps / self.horizon)


class PowerLawKLController(KLController):
    """β ← β·(KL/target)^α: raises β when KL is above target, lowers it when below (α > 0, default 1.5).

    A non-positive KL (the k1 estimate can be < 0) counts as far below target: β falls to `min_coef`."""

    kind = "power_law"

    def __init__(self, kl_coef: float, target_kl: float, alpha: float = 1.5, **bounds: float) -> None:
        if target_kl <= 0 or alpha <= 0:
            raise ValueError(f"power-law KL needs target_kl > 0 and alpha > 0, got {target_kl}, {alpha}")
        super().__init__(kl_coef, **bounds)
        self.target_kl, self.alpha = target_kl, alpha

    def _next(self, current_kl: float, n_steps: int) -> float:
        if current_kl <= 0:
            return self.min_coef
        return self.value * (current_kl / self.target_kl) ** self.alpha


class BandKLController(KLController):
    """Band rule: β ← β·up if KL > high, β·down if KL < low, else unchanged (up 1.2, down 0.8).

    Its `target_kl` is the band's geometric centre √(low·high) (the target of the default band [t/1.5, 1.5·t])."""

    kind = "band"

    def __init__(
        self, kl_coef: float, band: tuple[float, float], up: float = 1.2, down: float = 0.8, **bounds: float
    ) -> None:
        low, high = band
        if not 0 <= low < high:
            raise ValueError(f"KL band needs 0 ≤ low < high, got {band}")
        super().__init__(kl_coef, **bounds)
        self.band, self.up, self.down = (low, high), up, down
        self.target_kl = math.sqrt(low * high)

    def _next(self, current_kl: float, n_steps: int) -> float:
        low, high = self.band
        if current_kl > high:
            return self.value * self.up
        if current_kl < low:
            return self.value * self.down
        return self.value


class PIKLController(KLController):
    """PI control of log β from the log of the KL ratio, with anti-windup and a rate limit (`kind` "pi").

        e_n     = log(KL_n / target)                                     (tracking error; ×2 and ÷2 weigh alike)
        Δu_n    = clip(kp·(log KL_n − log KL_{n−1}) + ki·e_n,  ±log rate_limit)
        u_{n+1} = clamp(u_n + Δu_n,  log min_coef,  log max_coef),       β = exp(u)

    Why this shape: β does not set the KL, it sets how fast the policy drifts from the reference — the KL
    integrates the pull of the advantages minus β's pull back, and answers β only after the next updates. The
    power law (Δu = α·e) is a pure integrator in log β; around an integrating plant with a lag that is two
    integrators in a loop, which can only oscillate. The proportional term here acts on the KL's own change, the
    damping the loop lacks (it raises β while the KL is still rising, before the error has built up); the integral
    term removes the remaining offset. The proportional term reads the measured KL, not the error, so a new target
    (a stage boundary) moves β through the integral term only: no jump of β at the boundary.
    Anti-windup: the integrator is log β itself, stored clamped — at `max_coef` (or `min_coef`) it stops, and β
    leaves the bound at the first step whose correction points back inside. The rate limit bounds one step's change
    of β to ×/÷ `rate_limit`, so a single outlying KL (or a non-positive one, counted as `KL_FLOOR`·target) cannot
    throw β across its range. Needs min_coef > 0 (log β)."""

    kind = "pi"
    KL_FLOOR = 1e-3  # a KL ≤ this fraction of the target counts as this fraction (log of a non-positive KL)

    def __init__(
        self,
        kl_coef: float,
        target_kl: float,
        kp: float,
        ki: float,
        rate_limit: float = 2.0,
        previous_kl: float | None = None,
        **bounds: float,
    ) -> None:
        if target_kl <= 0 or kp < 0 or ki <= 0 or rate_limit <= 1:
            raise ValueError(
                f"PI KL needs target_kl > 0, kp ≥ 0, ki > 0 and rate_limit > 1, got {target_kl}, {kp}, {ki}, "
                f"{rate_limit}"
            )
        if bounds.get("min_coef", 0.0) <= 0:
            raise ValueError("PI KL works on log β: it needs min_coef > 0")
        super().__init__(kl_coef, **bounds)
        self.target_kl, self.kp, self.ki, self.rate_limit = target_kl, kp, ki, rate_limit
        self.previous_kl = previous_kl

    def _log_kl(self, kl: float) -> float:
        return math.log(max(kl, self.KL_FLOOR * self.target_kl))

    def _next(self, current_kl: float, n_steps: int) -> float:
        log_kl = self._log_kl(current_kl)
        change = 0.0 if self.previous_kl is None else log_kl - self._log_kl(self.previous_kl)
        self.previous_kl = current_kl
        step = self.kp * change + self.ki * (log_kl - math.log(self.target_kl))
        limit = math.log(self.rate_limit)
        # anti-windup: `update` clamps the result into [min_coef, max_coef] and the next step starts from there
        return self.value * math.exp(min(max(step, -limit), limit))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "previous_kl": self.previous_kl}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.previous_kl = state["previous_kl"]


@dataclass(frozen=True)
class ControllerSettings:
    """What a controller of any kind may read besides β and its bounds; each builder takes what its kind needs."""

    target_kl: float | None = None
    horizon: float = 10000.0
    alpha: float = 1.5
    band: tuple[float, float] | None = None
    kp: float = 1.0
    ki: float = 0.5
    rate_limit: float = 2.0
    previous_kl: float | None = None


ControllerBuilder = Callable[[float, ControllerSettings, dict[str, float]], "KLController"]
KL_CONTROLLERS: dict[str, ControllerBuilder] = {}


# Decorator: the function becomes `KL_CONTROLLERS[name]` (a new entry is one decorated function).
register_kl_controller = registrar(KL_CONTROLLERS, "KL controller")


def _needs_target(kind: str, settings: ControllerSettings) -> float:
    if settings.target_kl is None:
        raise ValueError(f"a {kind!r} KL controller needs target_kl")
    return settings.target_kl


@register_kl_controller("fixed")
def _fixed(kl_coef: float, settings: ControllerSettings, bounds: dict[str, float]) -> KLController:
    return FixedKLController(kl_coef, **bounds)


@register_kl_controller("adaptive")
def _adaptive(kl_coef: float, settings: ControllerSettings, bounds: dict[str, float]) -> KLController:
    return AdaptiveKLController(kl_coef, _needs_target("adaptive", settings), settings.horizon, **bounds)


@register_kl_controller("power_law")
def _power_law(kl_coef: float, settings: ControllerSettings, bounds: dict[str, float]) -> KLController:
    return PowerLawKLController(kl_coef, _needs_target("power_law", settings), settings.alpha, **bounds)


@register_kl_controller("band")
def _band(kl_coef: float, settings: ControllerSettings, bounds: dict[str, float]) -> KLController:
    band = settings.band
    if band is None:
        target = _needs_target("band", settings)
        band = (target / 1.5, target * 1.5)
    return BandKLController(kl_coef, band, **bounds)


@register_kl_controller("pi")
def _pi(kl_coef: float, settings: ControllerSettings, bounds: dict[str, float]) -> KLController:
    s = settings
    return PIKLController(kl_coef, _needs_target("pi", s), s.kp, s.ki, s.rate_limit, s.previous_kl, **bounds)


def build_kl_controller(
    kind: str, kl_coef: float, *, min_coef: float = 0.0, max_coef: float = math.inf, **settings: Any
) -> KLController:
    """A controller of the given kind from `ControllerSettings`' fields (target_kl, horizon, alpha, band, kp, ki,
    rate_limit, previous_kl); `band` defaults to [target/1.5, target·1.5] for the band rule."""
    if kind not in KL_CONTROLLERS:
        raise ValueError(f"unknown KL controller {kind!r}; expected one of {', '.join(KL_CONTROLLERS)}")
    bounds = {"min_coef": min_coef, "max_coef": max_coef}
    return KL_CONTROLLERS[kind](kl_coef, ControllerSettings(**settings), bounds)
