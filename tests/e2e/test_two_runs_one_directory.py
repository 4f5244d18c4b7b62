"""The issue's case through the real CLI: compare-kl-style runs (`trainer.resume_mode=disable`) one after another in
the same checkpoint directory. Before run identities, the second run pruned its own newest checkpoint, left `latest`
naming a deleted one, and its rollbacks loaded the first run's checkpoints.

One process (TP 1) and a deliberately weak, quick SFT start: what is tested is where the runs write and what they
load, not how well they learn.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiny import RECIPE, REPO
from megatron_ppo.tasks.addition.compare_kl import VARIANTS
from tests.faults.cases import QUICK


def train(directory: Path, overrides: list[str], log: Path, subcommand: str = "train") -> int:
    """`python -m megatron_ppo train` (or another recipe subcommand) as one process, its rendezvous on a port the OS
    picks, console lines unwrapped; the exit status."""
    command = [sys.executable, "-m", "megatron_ppo", subcommand, str(RECIPE), *QUICK,
               f"data.addition.work_dir={directory}/work", f"trainer.default_local_dir={directory}/ckpt",
               f"trainer.log_dir={directory}/tb", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "1000"}
    env.pop("MASTER_PORT", None)
    with log.open("w") as out:
        return subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                              timeout=900).returncode  # fmt: skip


def run_id(checkpoint: Path) -> str:
    return json.loads((checkpoint / "run.json").read_text())["run_id"]


@pytest.fixture
def first_run(quick_run: Path, tmp_path: Path) -> Path:
    """This test's copy of run A's directory (the quick run: 6 steps, a checkpoint every 2, the last 3 kept; its
    task cache, checkpoints, TensorBoard folder), so that what one test does there (a second run moving run A aside)
    is not another's start, in any order."""
    return Path(shutil.copytree(quick_run, tmp_path / "two-runs"))


@pytest.mark.floor
def test_a_second_new_run_in_the_directory_is_refused_and_changes_nothing(first_run: Path) -> None:
    ckpt = first_run / "ckpt"
    before = sorted(p.name for p in ckpt.iterdir())
    status = train(first_run, ["trainer.total_training_steps=3", "trainer.resume_mode=disable"], first_run / "b0.log")
    log = (first_run / "b0.log").read_text()
    assert status == 2, f"exit {status}; log tail:\n{log[-3000:]}"
    for part in (f"trainer.default_local_dir='{ckpt}' holds checkpoints of another run", "trainer.resume_mode=auto",
                 "another trainer.default_local_dir", "trainer.overwrite=true"):  # fmt: skip
        assert part in log, f"{part!r} missing from:\n{log[-3000:]}"
    assert sorted(p.name for p in ckpt.iterdir()) == before and (ckpt / "latest").read_text() == "step_6"


def test_overwrite_moves_the_first_run_aside_and_the_second_never_loads_it(first_run: Path) -> None:
    """Run B with trainer.overwrite=true and a KL threshold every actor update exceeds (a rollback whenever it can:
    the actor starts updating at step 3, so step 1's save is good, having passed step 2): it rolls back into step 1
    `guards.max_rollbacks` times, each at a lower learning rate, and the one after is a guard stop leaving step 1 in
    `latest`; then a resume, which must continue run B."""
    ckpt = first_run / "ckpt"
    first_id = run_id(ckpt / "step_6")
    overrides = ["trainer.total_training_steps=3", "trainer.resume_mode=disable", "trainer.overwrite=true",
                 "guards.kl_explosion_threshold=1e-9", "trainer.critic_warmup=2", "trainer.save_freq=1",
                 "trainer.max_ckpt_to_keep=2"]  # fmt: skip
    status = train(first_run, overrides, first_run / "b.log")
    log = (first_run / "b.log").read_text()
    assert status == 3, log[-3000:]  # a guard stop: its rollbacks are spent
    assert log.count("stopped: guard/kl_explosion stopped the run") == 1 and "guards.max_rollbacks=3 reached" in log
    (moved,) = (ckpt / "moved-aside").iterdir()
    assert sorted(p.name for p in moved.iterdir()) == ["latest", "step_2", "step_4", "step_6"], "run A, moved aside"
    assert {run_id(moved / f"step_{step}") for step in (2, 4, 6)} == {first_id}
    assert (ckpt / "latest").read_text() == "step_1", "latest names run B's good checkpoint"
    # the newest two (step 2 saved again by each replay), and step_1: the good checkpoint the rollbacks load
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_1", "step_2"]
    second_id = run_id(ckpt / "step_1")
    assert second_id != first_id and run_id(ckpt / "step_2") == second_id
    rolled_back_to = re.findall(r"rolled back to (\S+),", log)
    assert len(rolled_back_to) == 3, f"the KL threshold should have forced 3 rollbacks; log tail:\n{log[-3000:]}"
    assert all(run_id(Path(path)) == second_id for path in rolled_back_to), rolled_back_to
    assert sorted(p.name for p in (first_run / "tb").iterdir()) == sorted([first_id, second_id]), "a folder per run"

    # resumed with another learning rate: the optimizers load (megatron-core 0.19 stopped at the changed max_lr)
    resume = ["trainer.total_training_steps=3", "trainer.resume_mode=auto", "actor.optim.lr=2.0e-4"]
    status = train(first_run, resume, first_run / "c.log")
    log = (first_run / "c.log").read_text()
    assert status == 0, log[-3000:]
    assert f"resumed from {ckpt}/step_1 (named by {ckpt}/latest): run {second_id} continues" in log
    assert "actor.optim.lr: 0.0001 → 0.0002;" in log and "the run continues with the new values" in log, log[-3000:]


def test_two_compare_kl_invocations_write_apart_and_name_what_they_read(first_run: Path) -> None:
    """`compare-kl` twice with the same recipe directories (the second with another seed), each variant 2 steps."""
    outputs = []
    for seed in (1, 2):
        log = first_run / f"compare-kl-{seed}.log"
        status = train(first_run, ["trainer.total_training_steps=2", f"trainer.seed={seed}"], log, "compare-kl")
        assert status == 0, log.read_text()[-3000:]
        outputs.append(log.read_text())
    invocations = sorted((first_run / "compare-kl").iterdir())
    assert len(invocations) == 2, f"each invocation needs its own directory: {invocations}"
    for invocation, table in zip(invocations, outputs, strict=True):
        assert f"read from {invocation}" in table
        runs = set()
        for variant in VARIANTS:
            (latest,) = (invocation / variant / "checkpoints" / "latest").read_text().split()
            assert latest == "step_2"
            runs.add(run_id(invocation / variant / "checkpoints" / latest))
            (log_dir,) = (invocation / variant / "tensorboard").iterdir()
            assert f" {log_dir.relative_to(invocation)} " in table and log_dir.name in runs
        assert len(runs) == len(VARIANTS), "every variant is a run of its own"
