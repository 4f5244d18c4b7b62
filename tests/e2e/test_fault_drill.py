"""The fault drill in shortened form (`make drill` runs the full one): the tiny recipe with a NaN gradient on one
rank, a gradient spike, an out-of-memory error, a KL blow-up and an evaluation drop injected at fixed steps. The run
must finish, each guard must fire exactly at its step (read back from TensorBoard), and the policy must not end below
its SFT start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.drill.__main__ import SCHEDULES
from tests.drill.readback import check
from tests.e2e.tiny_runs import RECIPE, REPO, scalars


def test_every_guard_fires_at_its_fault_and_the_run_recovers(tiny_work: Path, tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nproc_per_node=2", "--standalone", "-m", "tests.drill", str(RECIPE),
               "--short", f"data.addition.work_dir={tiny_work}", f"trainer.default_local_dir={tmp_path}/ckpt",
               f"trainer.log_dir={tmp_path}/tb"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=1500, check=False)
    log = result.stdout + result.stderr
    assert result.returncode == 0, f"the drill exited {result.returncode}; log tail:\n{log[-5000:]}"
    assert "fault drill" in log and "drill passed" in log
    rows, problems = check(tmp_path / "tb", SCHEDULES["short"])
    assert not problems, problems
    assert {row.fault: (row.guard, row.fired_at) for row in rows} == {
        "nan_gradient": ("nonfinite", [2]), "loss_spike": ("loss_explosion + grad_norm", [3]),
        "out_of_memory": ("out_of_memory", [5]), "kl_blowup": ("kl_explosion + kl_bump + watch", [7]),
        "eval_drop": ("eval_drop", [8]),
    }  # fmt: skip
    assert all(row.recovered_by is not None for row in rows), rows
    logged = scalars(tmp_path / "tb")
    evaluations = logged["eval/reward_mean"]
    assert logged["guard/rollback"], "the KL blow-up and the evaluation drop must each roll back"
    assert evaluations[max(evaluations)] >= evaluations[0], f"held-out reward ended below the SFT start: {evaluations}"
