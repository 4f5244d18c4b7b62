"""The tiny mixture-of-experts recipe end to end through the real CLI on 2 processes with expert parallelism 2,
judged by its TensorBoard logs: held-out reward rises over the SFT start, and the router's load-balancing loss is
logged and stays near balance."""

from __future__ import annotations

import math

import pytest

from bench.tiny import REPO
from tests.e2e.tiny_runs import run
from tests.support.tensorboard import scalars

TINY_MOE = REPO / "recipes" / "tiny-moe-cpu.yaml"
# The dense test's shortening (bench.tiny.SHORT) with the recipe's own mini-batches of 128 (micro-batches of 64, one
# per replica: the SFT then takes one micro-batch a step, not two), half the SFT and 8 PPO steps. Measured side by
# side on 2 cores (2026-12-06): micro-batches of 32 (mini-batches of 64) 198 s, held-out 0.505 → 0.790; these 166 s,
# 0.560 → 0.835 (+0.26).
MOE_SHORT = ["actor.ppo_mini_batch_size=128", "critic.ppo_mini_batch_size=128",
             "data.addition.sft_steps=500", "trainer.total_training_steps=8"]  # fmt: skip


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny-moe")
    run(2, [*MOE_SHORT, f"data.addition.work_dir={root}/work", f"trainer.default_local_dir={root}/ckpt",
            f"trainer.log_dir={root}/tb"], root / "train.log",
        recipe=TINY_MOE)  # fmt: skip
    return {"scalars": scalars(root / "tb"), "log": (root / "train.log").read_text()}


def test_moe_ppo_raises_the_held_out_reward_over_the_sft_start(tiny_moe) -> None:
    evaluations = tiny_moe["scalars"]["eval/reward_mean"]
    start, end = evaluations[0], evaluations[max(evaluations)]
    assert end >= start + 0.10, f"held-out reward went from {start:.3f} (SFT) to {end:.3f} after PPO"


def test_load_balancing_loss_is_logged_every_step_near_balance(tiny_moe) -> None:
    logged = tiny_moe["scalars"]
    aux = logged.get("actor/moe_aux_loss", {})
    assert sorted(aux) == sorted(logged["actor/pg_loss"]), "actor/moe_aux_loss must be logged with every update"
    assert all(math.isfinite(v) and 0.9 <= v < 1.5 for v in aux.values()), f"load-balancing loss (~1: balanced): {aux}"
    assert "critic/moe_aux_loss" not in logged
