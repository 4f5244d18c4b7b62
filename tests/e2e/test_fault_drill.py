"""The fault drill in shortened form (`make drill` runs the full one): the tiny recipe with a NaN gradient on one rank,
a gradient spike, an out-of-memory error at the actor update's start and one mid-update, a KL blow-up between saves,
an evaluation drop and a KL blow-up in the last step of an iteration that ends with a save, injected at fixed steps.
The run must finish, each guard must fire exactly at its step (read back from TensorBoard), each rollback must load
the good checkpoint (never the save that holds the blow-up) and the evaluation drop's the best evaluation's (step
4's: measured 0.570 at the SFT start, 0.840 at step 4, 0.705 at step 8 before the drop's −0.5), the KL must be back
under its threshold after it, and held-out accuracy must rise by ≥ 0.10 over the SFT start (measured +0.205:
0.570 → 0.775). Then the guard stop: two plain processes (as `srun` starts them) stopped by NaN gradients exit
`GUARD_STOP_EXIT`, with one message and no traceback. Last, an out-of-memory error on one data-parallel rank only:
that rank stops the run with one message and `OUT_OF_MEMORY_STOP_EXIT` instead of a hang, its checkpoint left."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.ports import on_a_free_port
from bench.tiny import RECIPE, REPO
from megatron_ppo.checkpoint.directory import is_complete
from megatron_ppo.train.guards import GUARD_STOP_EXIT
from megatron_ppo.train.memory_backoff import OUT_OF_MEMORY_STOP_EXIT
from tests.drill.__main__ import MIN_GAIN, ONE_RANK_OOM_AT, SCHEDULES, STOP_AT
from tests.drill.readback import check
from tests.support.tensorboard import scalars


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
    rows, problems = check(tmp_path / "tb", SCHEDULES["short"], kl_threshold=1.0)
    assert not problems, problems
    kl = "kl_explosion + kl_bump + watch"
    assert {row.fault: (row.guard, row.fired_at, row.loaded) for row in rows} == {
        "nan_gradient": ("nonfinite", [2], ""), "loss_spike": ("loss_explosion + grad_norm", [3], "step_0"),
        "out_of_memory": ("out_of_memory", [5, 6], ""), "out_of_memory_mid_phase": ("out_of_memory", [5, 6], ""),
        "kl_blowup": (kl, [7, 11], "step_4"), "eval_drop": ("eval_drop", [8], "step_4"),
        "kl_blowup_at_save": (kl, [7, 11], "step_8"),
    }  # fmt: skip
    assert all(row.recovered_by is not None for row in rows), rows
    logged = scalars(tmp_path / "tb")
    evaluations = logged["eval/reward_mean"]
    # step 4's is the best evaluation the run holds at the drop (step 8's own is the dropped one): where it must land
    assert evaluations[4] > evaluations[0], f"step 4 is no longer the best evaluation before the drop: {evaluations}"
    assert logged["guard/rollback"], "the KL blow-ups, the loss spike and the evaluation drop must each roll back"
    gain = evaluations[max(evaluations)] - evaluations[0]
    assert gain >= MIN_GAIN["short"], f"held-out reward gained {gain:.3f} < {MIN_GAIN['short']}: {evaluations}"


def _two_plain_processes(command: list[str]) -> tuple[list[int | None], list[tuple[str, str]]]:
    """`command` as two ranks of one job started without torchrun (as `srun` starts them), on a free port (again on
    another when it was taken); their exit statuses and (stdout, stderr)."""

    def launch(port: int) -> tuple[list[int | None], list[tuple[str, str]]]:
        ranks = [
            subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={
                **os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(2)
        ]  # fmt: skip
        outputs = [process.communicate(timeout=900) for process in ranks]
        return [process.returncode for process in ranks], outputs

    return on_a_free_port(launch, log=lambda launched: "".join(map("".join, launched[1])))


def test_a_guard_stop_exits_with_its_status_and_one_message(tiny_work: Path, tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tests.drill", str(RECIPE), "--stop", f"data.addition.work_dir={tiny_work}",
               f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/tb"]  # fmt: skip
    statuses, outputs = _two_plain_processes(command)
    logs = [out + err for out, err in outputs]
    assert statuses == [GUARD_STOP_EXIT] * 2, f"exit statuses {statuses}; rank 0 log tail:\n{logs[0][-4000:]}"
    assert not any("Traceback" in log for log in logs), logs[0][-4000:]
    stops = [line for line in outputs[0][1].splitlines() if line.startswith("stopped: ")]
    assert len(stops) == 1 and not any(line.startswith("stopped: ") for line in outputs[1][1].splitlines()), stops
    assert "guard/nonfinite stopped the run" in stops[0] and "max_consecutive_skips=0" in stops[0], stops
    assert f"step_{STOP_AT - 2}" in stops[0] and f"exiting with {GUARD_STOP_EXIT}" in stops[0], stops
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step_{STOP_AT - 2}"


def test_out_of_memory_on_one_rank_stops_the_run_with_one_message_and_its_checkpoint(tiny_work: Path, tmp_path) -> None:
    """DP 2: the last rank alone runs out of memory in its second actor mini-batch of a step; the other waits in
    the gradient reduce. Within the agreement's timeout (5 s) plus the teardown, both processes end (no hang): the
    failed rank with `OUT_OF_MEMORY_STOP_EXIT` and one `stopped:` line naming the phase, the size to lower and the
    checkpoint `latest` names, which is complete and untouched."""
    command = [sys.executable, "-m", "tests.drill", str(RECIPE), "--oom-one-rank",
               f"data.addition.work_dir={tiny_work}", f"trainer.default_local_dir={tmp_path}/ckpt",
               f"trainer.log_dir={tmp_path}/tb"]  # fmt: skip
    statuses, outputs = _two_plain_processes(command)
    assert statuses[1] == OUT_OF_MEMORY_STOP_EXIT and statuses[0] != 0, (statuses, outputs[1][1][-3000:])
    stops = [line for line in outputs[1][1].splitlines() if line.startswith("stopped: ")]
    assert len(stops) == 1, outputs[1][1][-3000:]
    latest = (tmp_path / "ckpt" / "latest").read_text().strip()
    # the save after the step before may still be writing (asynchronous saves): a stop at once leaves `latest` on the
    # newest published checkpoint, complete, which the message names
    published = (f"step_{ONE_RANK_OOM_AT - 1}", f"step_{ONE_RANK_OOM_AT - 2}")
    assert latest in published and is_complete(tmp_path / "ckpt" / latest), latest
    for part in ("actor update", "out of memory on some ranks only", "actor.ppo_micro_batch_size_per_gpu", latest,
                 f"exit {OUT_OF_MEMORY_STOP_EXIT}"):  # fmt: skip
        assert part in stops[0], (part, stops[0])
