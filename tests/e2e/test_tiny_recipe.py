"""The tiny recipe end to end through the real CLI, judged by its TensorBoard logs; resume after SIGKILL; and the
same first steps under TP=1, TP=2 and PP=2."""

from __future__ import annotations

import math
import signal
from pathlib import Path

import pytest

from tests.e2e.tiny_runs import run, run_and_kill_after_checkpoint, run_and_signal_after_step, scalars

METRICS = [
    "actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/kl_loss", "actor/entropy",
    "actor/grad_norm", "actor/lr", "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var",
    "critic/grad_norm", "critic/values_mean", "reward/mean", "response_length/mean", "kl/coef", "kl/target",
    "kl/stage", "kl/mean", "kl/std", "train/skipped_steps", "perf/tokens_per_s", "perf/step_time_s",
    "eval/reward_mean",
]  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_work) -> dict:
    """One shortened run (TP=2 on 2 processes), on the shared task cache."""
    root = tmp_path_factory.mktemp("tiny")
    common = [f"data.addition.work_dir={tiny_work}"]
    run(2, [*common, "trainer.total_training_steps=12", f"trainer.default_local_dir={root}/ckpt",
            f"trainer.log_dir={root}/tb"], root / "train.log")  # fmt: skip
    return {"root": root, "common": common, "scalars": scalars(root / "tb"), "log": (root / "train.log").read_text()}


def test_every_metric_is_logged_and_finite(tiny) -> None:
    logged = tiny["scalars"]
    missing = [m for m in METRICS if m not in logged]
    assert not missing, f"metrics missing from TensorBoard: {missing}"
    bad = {tag: step for tag, series in logged.items() for step, value in series.items() if not math.isfinite(value)}
    assert not bad, f"non-finite values logged: {bad}"


def test_ppo_raises_the_held_out_reward_over_the_sft_start(tiny) -> None:
    evaluations = tiny["scalars"]["eval/reward_mean"]
    start, end = evaluations[0], evaluations[max(evaluations)]
    assert end >= start + 0.10, f"held-out reward went from {start:.3f} (SFT) to {end:.3f} after PPO"


def test_kl_stays_near_each_stage_target(tiny) -> None:
    logged = tiny["scalars"]
    by_stage: dict[int, list[float]] = {}
    for step, stage in logged["kl/stage"].items():
        if step in logged.get("kl/target", {}):
            by_stage.setdefault(int(stage), []).append(logged["kl/mean"][step] / logged["kl/target"][step])
    assert by_stage, "no staged KL targets were logged"
    for stage, ratios in by_stage.items():
        mean_ratio = sum(ratios) / len(ratios)
        assert mean_ratio < 3.0, f"stage {stage}: KL averaged {mean_ratio:.2f} × its target"


def test_the_run_ends_with_the_summary_table(tiny) -> None:
    assert "held-out reward (mean)" in tiny["log"] and "TensorBoard" in tiny["log"]


SIX_STEPS = ["trainer.total_training_steps=6", "trainer.save_freq=2", "trainer.test_freq=0"]
COMPARED = ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "critic/vf_loss", "kl/mean", "kl/coef", "reward/mean",
            "actor/grad_norm")  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory) -> dict[str, dict[int, float]]:
    directory = tmp_path_factory.mktemp("uninterrupted")
    run(2, [*tiny["common"], *SIX_STEPS, f"trainer.default_local_dir={directory}/ckpt",
            f"trainer.log_dir={directory}/tb"], directory / "train.log")  # fmt: skip
    return scalars(directory / "tb")


def _assert_same_after(resumed, uninterrupted, first_step: int, tags=COMPARED, rel_tol=1e-6, abs_tol=1e-6) -> None:
    for tag in tags:
        for step in range(first_step, 7):
            assert math.isclose(resumed[tag][step], uninterrupted[tag][step], rel_tol=rel_tol, abs_tol=abs_tol), (
                f"{tag} at step {step}: resumed {resumed[tag][step]} vs uninterrupted {uninterrupted[tag][step]}"
            )


def test_resume_after_sigkill_reproduces_the_uninterrupted_run(tiny, uninterrupted, tmp_path: Path) -> None:
    common = [*tiny["common"], *SIX_STEPS]
    killed = [*common, f"trainer.default_local_dir={tmp_path}/b/ckpt"]
    run_and_kill_after_checkpoint(2, [*killed, f"trainer.log_dir={tmp_path}/b/tb0"], tmp_path / "b" / "ckpt", 2,
                                  tmp_path / "b0.log")  # fmt: skip
    run(2, [*killed, f"trainer.log_dir={tmp_path}/b/tb1"], tmp_path / "b1.log")
    assert "resumed from" in (tmp_path / "b1.log").read_text()
    _assert_same_after(scalars(tmp_path / "b" / "tb1"), uninterrupted, first_step=3)


def test_preemption_signal_checkpoints_exits_for_requeue_and_resumes_exactly(tiny, uninterrupted, tmp_path) -> None:
    preempted = [*tiny["common"], *SIX_STEPS, "trainer.save_freq=0", f"trainer.default_local_dir={tmp_path}/ckpt"]
    status = run_and_signal_after_step(2, [*preempted, f"trainer.log_dir={tmp_path}/tb0"], 2, signal.SIGUSR1,
                                       tmp_path / "c0.log")  # fmt: skip
    log = (tmp_path / "c0.log").read_text()
    assert status != 0 and "exiting with 75" in log, f"exit {status}; log tail:\n{log[-3000:]}"
    saved_step = int((tmp_path / "ckpt" / "latest").read_text().strip().removeprefix("step_"))
    assert 2 <= saved_step < 6, f"the preemption checkpoint is at step {saved_step}"
    run(2, [*preempted, f"trainer.log_dir={tmp_path}/tb1"], tmp_path / "c1.log")
    _assert_same_after(scalars(tmp_path / "tb1"), uninterrupted, first_step=saved_step + 1)


TP1 = [f"{role}.megatron.tensor_model_parallel_size=1" for role in ("actor", "ref", "critic")]
# A changed layout changes the floating-point order of the reductions, not the computation.
ACROSS_LAYOUTS = ("actor/pg_loss", "actor/ppo_kl", "actor/pg_clipfrac", "critic/vf_loss", "kl/coef", "kl/mean")


@pytest.mark.parametrize("start, then", [("tp2", "tp1"), ("tp1", "tp2")])
def test_resume_across_a_changed_layout_continues_the_run(tiny, uninterrupted, tmp_path: Path, start, then) -> None:
    """Saved at TP=2 on 2 processes, resumed at TP=1 on 1 process (and the reverse), optimizer states included:
    Megatron reshards the checkpoint, and the metrics after the resume follow the uninterrupted TP=2 run."""
    layouts = {"tp2": (2, []), "tp1": (1, TP1)}
    common = [*tiny["common"], *SIX_STEPS, f"trainer.default_local_dir={tmp_path}/ckpt"]
    nproc, layout = layouts[start]
    run(nproc, [*common, *layout, "trainer.exit_interval=2", f"trainer.log_dir={tmp_path}/tb0"], tmp_path / "a.log")
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step_2"
    nproc, layout = layouts[then]
    run(nproc, [*common, *layout, f"trainer.log_dir={tmp_path}/tb1"], tmp_path / "b.log")
    assert "resumed from" in (tmp_path / "b.log").read_text()
    _assert_same_after(scalars(tmp_path / "tb1"), uninterrupted, first_step=3, tags=ACROSS_LAYOUTS, rel_tol=1e-3,
                       abs_tol=2e-3)  # fmt: skip


def _two_steps(tiny, nproc: int, layout: list[str], directory: Path) -> dict[str, dict[int, float]]:
    run(nproc, [*tiny["common"], *layout, "trainer.total_training_steps=2", "trainer.test_freq=0",
                f"trainer.default_local_dir={directory}/ckpt", f"trainer.log_dir={directory}/tb"],
        directory / "train.log")  # fmt: skip
    return scalars(directory / "tb")


@pytest.fixture(scope="module")
def two_steps_tp2(tiny, tmp_path_factory) -> dict[str, dict[int, float]]:
    return _two_steps(tiny, 2, [], tmp_path_factory.mktemp("tp2"))


LAYOUTS = {
    "tp1": (1, TP1),
    "pp2": (2, [f"{r}.megatron.{k}" for r in ("actor", "ref", "critic")
                for k in ("tensor_model_parallel_size=1", "pipeline_model_parallel_size=2")]),
}  # fmt: skip


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_first_steps_agree_with_the_tp2_run(tiny, two_steps_tp2, tmp_path: Path, name: str) -> None:
    nproc, layout = LAYOUTS[name]
    ours, reference = _two_steps(tiny, nproc, layout, tmp_path), two_steps_tp2
    for tag in ("actor/pg_loss", "critic/vf_loss", "actor/entropy", "kl/mean", "critic/values_mean"):
        for step in (1, 2):
            assert math.isclose(ours[tag][step], reference[tag][step], rel_tol=1e-4, abs_tol=1e-5), (
                f"{name}: {tag} at step {step} is {ours[tag][step]}, TP=2 gave {reference[tag][step]}"
            )
