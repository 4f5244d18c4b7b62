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


def test_a_probe_run_is_judged_on_the_probe_and_its_batch_kl_beside_it() -> None:
    """With `feedback: probe` the tracked KL is `kl/probe_mean` (the run summary and compare-kl judge it); the batch's
    `kl/mean` is judged beside it with its noise share, which the probe has none of (its rows never change)."""
    from megatron_ppo.train.kl_coefficients import logged_tracking, tracked_kl_prefix

    assert tracked_kl_prefix(load_config(TINY, ["algorithm.kl_ctrl.feedback=probe"])) == "kl/probe_"
    assert tracked_kl_prefix(load_config(TINY, ["algorithm.kl_ctrl.feedback=update"])) == "kl/"
    stages = [0] * 2 + [1] * 4 + [2] * 15 + [3] * 9
    targets = [None] * 2 + [0.2] * 4 + [0.3] * 15 + [0.4] * 9
    history = [{"step": float(n), "kl/stage": float(stages[n - 1]), "kl/mean": 1.5 * (targets[n - 1] or 0.0),
                "kl/stderr": 0.01, "kl/probe_mean": targets[n - 1] or 0.0, "kl/probe_stderr": 0.01}
               | ({"kl/target": targets[n - 1]} if targets[n - 1] else {}) for n in range(1, 31)]  # fmt: skip
    probe, batch = logged_tracking(history, "kl/probe_"), logged_tracking(history, "kl/")
    assert (probe.hits, probe.judged, probe.max_ratio) == (22, 22, pytest.approx(1.0)), probe
    assert math.isnan(probe.noise_hits), "the probe's standard error is an offset constant over steps, not noise"
    assert (batch.hits, batch.judged, batch.max_ratio) == (0, 22, pytest.approx(1.5)), batch
    assert batch.noise_hits == pytest.approx(2 * chance_within_band(0.01 / 0.3) + 13 * chance_within_band(0.01 / 0.45)
                                             + 7 * chance_within_band(0.01 / 0.6))  # fmt: skip
    config = load_config(TINY)
    assert recipe_tracking(config, 30, history, "kl/probe_").hits == 22
    assert logged_tracking([{"step": 1.0, "kl/mean": 0.1}], "kl/") is None, "no target logged: nothing to judge"
