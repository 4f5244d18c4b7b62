"""The PI KL controller against a closed-form plant: the KL answering β with a first-order lag, as measured on the
tiny recipe (`docs/kl-tracking.md`): log KL_{n+1} = (1 − λ)·log KL_n + λ·(c − γ·log β_n), λ = 0.2, γ = 1 (the KL
settles ∝ 1/β with a time constant of five steps). The controller reads the KL of the step it just made (feedback
"update") or the one before (feedback "experience"); it must settle within SETTLE_STEPS of a target step (a stage
boundary) without overshooting by more than 25 %, come off a bound at once (anti-windup), and move β at most by its
rate limit in one step."""

from __future__ import annotations

import math

import pytest

from megatron_ppo.algo import KLStage, PIKLController, StagedKLSchedule, build_kl_controller

LAG, GAIN = 0.2, 1.0  # λ and γ of the plant (fitted to `make train`'s 30 steps)
BETA_EQ = 0.25  # the β that holds the old target at the start
SETTLE_STEPS = 7  # the stated settling time: in the ±10 % band for good this many steps after the target moves
MAX_OVERSHOOT = 0.25


def plant(kl_start: float, controller, steps: int, delay: int) -> list[float]:
    """The KL of each step, from equilibrium at `kl_start` under β = BETA_EQ; the controller updated after each step
    from the KL `delay` steps before it."""
    c = math.log(kl_start) + GAIN * math.log(BETA_EQ)
    log_kl, kls = math.log(kl_start), [kl_start]
    for _ in range(steps):
        log_kl = (1 - LAG) * log_kl + LAG * (c - GAIN * math.log(controller.value))
        kls.append(math.exp(log_kl))
        controller.update(kls[-1 - delay])
    return kls


def pi(target: float, **kwargs) -> PIKLController:
    return build_kl_controller("pi", BETA_EQ, target_kl=target, min_coef=0.01, max_coef=0.5, **kwargs)


def settling(kls: list[float], target: float) -> tuple[int, float]:
    """(first step from which every KL lies within ±10 % of `target`, largest overshoot past it as a fraction)."""
    ratios = [kl / target for kl in kls]
    settled = next(n for n in range(len(ratios)) if all(abs(r - 1) <= 0.1 for r in ratios[n:]))
    start = ratios[0]
    overshoot = max(r - 1 for r in ratios) if start < 1 else max(1 - r for r in ratios)
    return settled, overshoot


@pytest.mark.parametrize("delay", [0, 1], ids=["update-feedback", "experience-feedback"])
@pytest.mark.parametrize(("old", "new"), [(0.2, 0.3), (0.3, 0.4), (0.4, 0.3)])
def test_pi_settles_within_its_stated_steps_after_a_target_step(old: float, new: float, delay: int) -> None:
    kls = plant(old, pi(new), steps=40, delay=delay)
    settled, overshoot = settling(kls, new)
    assert settled <= SETTLE_STEPS, f"KL {old} → target {new}: settled only at step {settled}: {kls[:15]}"
    assert overshoot <= MAX_OVERSHOOT, f"KL {old} → target {new}: overshot by {overshoot:.0%}: {kls[:15]}"


# The gains for the probe's KL (`feedback: probe`): the KL of the policy the update just left, no delay, so the
# integral gain doubles (the tiny recipe's kp 1.0, ki 1.0): a target step settles in PROBE_SETTLE_STEPS, overshooting
# by at most PROBE_MAX_OVERSHOOT. The same gain on the experience KL, one step late, rings (below).
PROBE_GAINS = {"kp": 1.0, "ki": 1.0}
PROBE_SETTLE_STEPS, PROBE_MAX_OVERSHOOT = 4, 0.1


@pytest.mark.parametrize(("old", "new"), [(0.2, 0.3), (0.3, 0.4), (0.4, 0.3)])
def test_the_probe_gains_settle_faster_on_the_kl_of_the_step_just_made(old: float, new: float) -> None:
    settled, overshoot = settling(plant(old, pi(new, **PROBE_GAINS), steps=40, delay=0), new)
    assert settled <= PROBE_SETTLE_STEPS and overshoot <= PROBE_MAX_OVERSHOOT, (old, new, settled, overshoot)
    slower, _ = settling(plant(old, pi(new), steps=40, delay=0), new)
    assert slower > settled, "ki 0.5 (the gains for the update's KL) takes longer on the same feedback"


def test_the_probe_gains_ring_on_a_kl_one_step_late() -> None:
    """Why `experience` feedback keeps ki 0.5: ki 1.0 acting on the KL of the step before overshoots the 0.2 → 0.3
    boundary by over 20 % and needs twice the stated steps."""
    settled, overshoot = settling(plant(0.2, pi(0.3, **PROBE_GAINS), steps=40, delay=1), 0.3)
    assert settled > SETTLE_STEPS and overshoot > 0.2, (settled, overshoot)


def test_the_power_law_oscillates_on_the_same_plant_where_the_pi_rule_settles() -> None:
    """The cause of the issue, in closed form: β ← β·(KL/target)^1.5 is an integrator acting on a lagging KL; with
    the experience KL's one step of delay its swings grow (it never settles within 40 steps)."""
    kls = plant(0.3, build_kl_controller("power_law", BETA_EQ, target_kl=0.4, min_coef=0.01, max_coef=0.5), 40, 1)
    with pytest.raises(StopIteration):
        settling(kls, 0.4)
    assert max(kls[20:]) / 0.4 > 1.5, f"the power law held its target: {kls}"


def test_anti_windup_leaves_max_coef_at_the_first_step_the_kl_is_below_target() -> None:
    """Pinned at max_coef by a KL it cannot bring down, then given a KL under target: β leaves the bound on that
    very step (an integrator that kept integrating past the bound would hold β there while it unwinds)."""
    controller = pi(0.3)
    for _ in range(20):
        controller.update(1.2)  # 4× the target: far beyond what max_coef can hold
    assert controller.value == 0.5
    controller.update(0.25)
    assert controller.value < 0.5 * 0.97, f"β stayed near max_coef ({controller.value}) with the KL under target"


def test_one_outlying_kl_moves_beta_by_at_most_the_rate_limit() -> None:
    controller = pi(0.3, rate_limit=2.0)
    controller.update(0.3)
    for kl, bound in ((300.0, 2.0), (-1.0, 0.5)):  # an outlier up, then a negative k1 estimate
        before = controller.value
        controller.update(kl)
        assert controller.value == pytest.approx(before * bound), f"KL {kl}: β {before} → {controller.value}"


def test_pi_state_round_trips_exactly() -> None:
    kls = [0.3 * (1 + 0.1 * ((i * 7) % 5 - 2)) for i in range(30)]
    original = pi(0.3)
    for kl in kls[:10]:
        original.update(kl)
    restored = pi(0.3)
    restored.load_state_dict(original.state_dict())
    assert [restored.update(kl) for kl in kls[10:]] == [original.update(kl) for kl in kls[10:]]


def test_staged_pi_carries_the_last_kl_across_a_boundary_and_restores_it() -> None:
    """The proportional term reads the KL's change, also across a stage boundary (no kick from the new target: with
    the KL unchanged, β moves by the integral term alone); a restored schedule continues exactly."""
    stages = [KLStage("a", 10, "pi", target_kl=0.3), KLStage("b", 30, "pi", target_kl=0.4)]
    schedule = StagedKLSchedule(stages, total_steps=30, kl_coef=0.25, unit="step", min_coef=0.01, max_coef=0.5)
    for _ in range(9):
        schedule.update(0.3)
    assert schedule.value == pytest.approx(0.25), "on target: β holds"
    schedule.update(0.3)  # step 10: the controller now aims at stage b's 0.4
    assert schedule.value == pytest.approx(0.25 * math.exp(0.5 * math.log(0.3 / 0.4)))
    restored = StagedKLSchedule(stages, total_steps=30, kl_coef=0.25, unit="step", min_coef=0.01, max_coef=0.5)
    restored.load_state_dict(schedule.state_dict())
    kls = [0.35, 0.41, 0.38, 0.44, 0.4]
    assert [restored.update(kl) for kl in kls] == [schedule.update(kl) for kl in kls]


def test_pi_refuses_a_zero_floor_and_bad_gains() -> None:
    with pytest.raises(ValueError, match="min_coef > 0"):
        build_kl_controller("pi", 0.1, target_kl=0.3)
    with pytest.raises(ValueError, match="rate_limit > 1"):
        pi(0.3, rate_limit=1.0)
