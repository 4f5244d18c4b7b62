"""KL controllers and the staged KL schedule: direction, clamps, stage boundaries, continuity, exact restore."""

from __future__ import annotations

import math

import pytest

from megatron_ppo.algo import (
    AdaptiveKLController,
    BandKLController,
    FixedKLController,
    KLStage,
    PowerLawKLController,
    StagedKLSchedule,
    build_kl_controller,
)

STAGES = [
    KLStage("warmup", 0.05, "warmup"),
    KLStage("early", 0.20, "power_law", target_kl=0.008),
    KLStage("mid", 0.70, "power_law", target_kl=0.012, guards={"kl_explosion_threshold": 0.5}),
    KLStage("late", 1.0, "power_law", target_kl=0.015),
]


def _schedule(**kwargs) -> StagedKLSchedule:
    return StagedKLSchedule(STAGES, total_steps=kwargs.pop("total_steps", 100), kl_coef=0.001, **kwargs)


def test_power_law_raises_beta_when_kl_is_above_target_and_lowers_it_below() -> None:
    above = PowerLawKLController(0.01, target_kl=0.01, alpha=1.5)
    assert above.update(0.04) == pytest.approx(0.01 * 4**1.5)
    below = PowerLawKLController(0.01, target_kl=0.01, alpha=1.5)
    assert below.update(0.0025) == pytest.approx(0.01 * 0.25**1.5)
    on_target = PowerLawKLController(0.01, target_kl=0.01)
    assert on_target.update(0.01) == pytest.approx(0.01)


def test_power_law_with_non_positive_kl_falls_to_the_floor() -> None:
    controller = PowerLawKLController(0.01, target_kl=0.01, min_coef=1e-4)
    assert controller.update(-0.001) == 1e-4


def test_band_rule_multiplies_outside_the_band_only() -> None:
    controller = BandKLController(0.1, band=(0.01, 0.02))
    assert controller.update(0.03) == pytest.approx(0.12)
    assert controller.update(0.015) == pytest.approx(0.12)
    assert controller.update(0.001) == pytest.approx(0.096)


def test_adaptive_error_is_clipped_to_twenty_percent() -> None:
    controller = AdaptiveKLController(0.1, target_kl=0.01, horizon=100)
    assert controller.update(1.0, n_steps=10) == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    assert controller.update(0.0, n_steps=10) == pytest.approx(0.1 * 1.02 * (1 - 0.2 * 10 / 100))


@pytest.mark.parametrize("kind", ["adaptive", "power_law", "band"])
def test_controllers_clamp_to_bounds(kind: str) -> None:
    high = build_kl_controller(kind, 0.5, target_kl=0.01, horizon=1, min_coef=1e-3, max_coef=0.6)
    for _ in range(50):
        high.update(10.0, n_steps=10)
    assert high.value == 0.6
    low = build_kl_controller(kind, 0.5, target_kl=0.01, horizon=1, min_coef=1e-3, max_coef=0.6)
    for _ in range(200):
        low.update(1e-6, n_steps=10)
    assert low.value == 1e-3


def test_fixed_controller_never_moves_and_state_round_trips() -> None:
    controller = FixedKLController(0.05)
    controller.update(100.0)
    assert controller.value == 0.05
    restored = PowerLawKLController(0.1, target_kl=0.01)
    with pytest.raises(ValueError, match="'fixed' KL controller"):
        restored.load_state_dict(controller.state_dict())


def test_non_finite_kl_is_refused() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        PowerLawKLController(0.1, target_kl=0.01).update(math.nan)
    with pytest.raises(ValueError, match="non-finite"):
        _schedule().update(math.inf)


def test_stages_change_at_the_right_steps() -> None:
    schedule = _schedule(total_steps=100)
    assert schedule.stage_ends == [5, 20, 70, 100]
    seen = {}
    for _ in range(110):
        seen.setdefault(schedule.stage.name, schedule.step)
        schedule.update(0.01)
    assert seen == {"warmup": 0, "early": 5, "mid": 20, "late": 70}
    assert schedule.stage.name == "late", "steps past the planned end stay in the last stage"


def test_stage_ends_in_steps() -> None:
    stages = [KLStage("a", 10, "fixed"), KLStage("b", 30, "power_law", target_kl=0.01)]
    schedule = StagedKLSchedule(stages, total_steps=30, kl_coef=0.01, unit="step")
    assert schedule.stage_ends == [10, 30]
    assert [schedule.stage_index_at(s) for s in (0, 9, 10, 29, 30)] == [0, 0, 1, 1, 1]


def test_warmup_starts_with_kl_off_and_ramps_linearly_to_the_start_value() -> None:
    schedule = _schedule(total_steps=100, min_coef=1e-4)
    values = [schedule.value]
    for _ in range(5):
        values.append(schedule.update(10.0))  # a huge KL must not matter during warm-up
    assert values == pytest.approx([0.0, 0.0002, 0.0004, 0.0006, 0.0008, 0.001])
    assert schedule.stage.name == "early"


def test_beta_is_continuous_across_stage_boundaries() -> None:
    """At each boundary β carries over; with KL on the new stage's target it stays exactly where it was."""
    schedule = _schedule(total_steps=100)
    for _ in range(5):
        schedule.update(0.0)
    for step in range(5, 99):
        before = schedule.value
        next_stage = STAGES[schedule.stage_index_at(step + 1)]
        schedule.update(next_stage.target_kl)
        assert schedule.value == pytest.approx(before), f"β jumped at step {step + 1}"


def test_stage_controller_uses_its_own_target() -> None:
    schedule = _schedule(total_steps=100)
    for _ in range(20):
        schedule.update(0.008)  # warm-up, then exactly on the early target
    assert schedule.stage.name == "mid" and schedule.value == pytest.approx(0.001 * (0.008 / 0.012) ** 1.5)


def test_schedule_clamps_after_warmup() -> None:
    schedule = _schedule(total_steps=100, min_coef=1e-4, max_coef=0.002)
    for _ in range(30):
        schedule.update(1.0)
    assert schedule.value == 0.002
    for _ in range(30):
        schedule.update(1e-9)
    assert schedule.value == 1e-4


def test_guard_overrides_follow_the_stage() -> None:
    schedule = _schedule(total_steps=100)
    for _ in range(20):
        assert schedule.guard_overrides == {}
        schedule.update(0.01)
    assert schedule.guard_overrides == {"kl_explosion_threshold": 0.5}


def test_state_round_trip_mid_stage_reproduces_the_trajectory_exactly() -> None:
    kls = [0.001 * (1 + (i * 37) % 23) for i in range(100)]
    original = _schedule(total_steps=100, min_coef=1e-5, max_coef=0.1)
    for kl in kls[:37]:
        original.update(kl)
    assert original.stage.name == "mid"
    restored = _schedule(total_steps=100, min_coef=1e-5, max_coef=0.1)
    restored.load_state_dict(original.state_dict())
    for kl in kls[37:]:
        assert restored.update(kl) == original.update(kl)
    assert restored.state_dict() == original.state_dict()


def test_restoring_into_a_different_schedule_is_refused() -> None:
    state = _schedule(total_steps=100).state_dict()
    with pytest.raises(ValueError, match="differ from the config"):
        _schedule(total_steps=200).load_state_dict(state)


def test_invalid_schedules_are_refused() -> None:
    with pytest.raises(ValueError, match="only the first"):
        StagedKLSchedule([KLStage("a", 0.5, "fixed"), KLStage("b", 1.0, "warmup")], 10, 0.01)
    with pytest.raises(ValueError, match="must not decrease"):
        StagedKLSchedule([KLStage("a", 0.5, "fixed"), KLStage("b", 0.4, "fixed")], 10, 0.01)


def test_stages_too_short_for_a_step_are_skipped_in_a_short_run() -> None:
    schedule = StagedKLSchedule(STAGES, total_steps=2, kl_coef=0.001)
    assert schedule.stage_ends == [0, 0, 1, 2]
    assert [schedule.stage_index_at(s) for s in (0, 1, 5)] == [2, 3, 3]
    assert schedule.value == 0.001, "no warm-up step: the run starts at the start value"
