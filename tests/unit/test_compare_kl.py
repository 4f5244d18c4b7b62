"""compare-kl: each invocation's variants write under a directory of their own."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_ppo.config import load_config
from megatron_ppo.tasks.addition.compare_kl import recipe_tracking, variants
from megatron_ppo.train.kl_coefficients import TRACKING_BAND, chance_within_band

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"


def test_each_invocation_and_variant_has_its_own_directories() -> None:
    config = load_config(TINY, ["trainer.default_local_dir=/out/tiny/checkpoints"])
    first, second = variants(config, "20261201-000000-aaaaaa"), variants(config, "20261201-000001-bbbbbb")
    directories = [(v.trainer.default_local_dir, v.trainer.log_dir) for v in [*first.values(), *second.values()]]
    assert len({d for pair in directories for d in pair}) == 20, directories
    staged = first["staged-pi"].trainer
    assert staged.default_local_dir == "/out/tiny/compare-kl/20261201-000000-aaaaaa/staged-pi/checkpoints"
    assert staged.log_dir == "/out/tiny/compare-kl/20261201-000000-aaaaaa/staged-pi/tensorboard"
    assert all(v.trainer.resume_mode == "disable" for v in first.values())


def test_the_staged_variants_differ_only_in_the_rule_of_their_target_stages() -> None:
    config = load_config(TINY)
    runs = variants(config, "20261201-000000-aaaaaa")
    for name, rule in (("staged-power-law", "power_law"), ("staged-pi", "pi")):
        stages = runs[name].algorithm.kl_ctrl.stages
        assert [s.controller for s in stages] == ["warmup", rule, rule, rule], name
        assert [s.target_kl for s in stages] == [s.target_kl for s in config.algorithm.kl_ctrl.stages]


def test_tracking_judges_each_stage_after_its_first_two_steps() -> None:
    """Steps 1–2 warm-up (no target); early 3–6, mid 7–21, late 22–30 on the tiny recipe's 30 steps."""
    config = load_config(TINY)
    history = [{"step": float(n), "kl/mean": 0.0 if n <= 2 else 0.21 if n <= 6 else 0.6 if n <= 21 else 0.4}
               for n in range(1, 31)]  # fmt: skip
    history[22]["kl/mean"] = 0.7  # step 23: a late stage's second step, not judged
    tracking = recipe_tracking(config, 30, history)
    assert (tracking.hits, tracking.judged) == (2 + 7, 2 + 13 + 7), tracking
    assert tracking.max_ratio == pytest.approx(2.0) and tracking.mean_error == pytest.approx((2 * 0.05 + 13) / 22)


def test_the_noise_ceiling_is_the_chance_that_a_kl_on_target_measures_within_the_band() -> None:
    """`chance_within_band` against sampling: a KL exactly on target, measured with a normal error of kl/stderr,
    lands within ±10 % as often as it says (95 % at a relative error of 0.1/1.96); a run's `noise_hits` sums it over
    the judged steps, each at its own kl/stderr ÷ kl/mean."""
    generator = torch.Generator().manual_seed(0)
    for relative in (0.1 / 1.96, 0.09, 0.2):
        measured = 1.0 + relative * torch.randn(400_000, generator=generator)
        sampled = float(((measured - 1.0).abs() <= TRACKING_BAND).double().mean())
        assert chance_within_band(relative) == pytest.approx(sampled, abs=0.003), relative
    assert chance_within_band(0.1 / 1.96) == pytest.approx(0.95, abs=1e-4)
    config = load_config(TINY)
    history = [{"step": float(n), "kl/mean": 0.0 if n <= 2 else 0.2 if n <= 6 else 0.3 if n <= 21 else 0.4,
                "kl/stderr": 0.0 if n <= 2 else 0.018} for n in range(1, 31)]  # fmt: skip
    tracking = recipe_tracking(config, 30, history)
    expected = 2 * chance_within_band(0.09) + 13 * chance_within_band(0.06) + 7 * chance_within_band(0.045)
    assert tracking.noise_hits == pytest.approx(expected) and tracking.noise_ceiling == pytest.approx(expected / 22)
    assert math.isnan(recipe_tracking(config, 30, [{k: v for k, v in h.items() if k != "kl/stderr"}
                                                   for h in history]).noise_hits)  # fmt: skip
