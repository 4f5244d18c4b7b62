"""compare-kl: each invocation's variants write under a directory of their own."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ppo.config import load_config
from megatron_ppo.tasks.addition.compare_kl import recipe_tracking, variants

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
