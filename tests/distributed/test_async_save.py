"""Asynchronous saves (`trainer.async_save`, `checkpoint/async_save.py`): the save returns before its write ends,
training goes on, and what is published resumes like a synchronous save; nothing is named before it is published."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import torch

from bench.ports import on_a_free_port
from bench.tiny import REPO
from megatron_ppo.checkpoint import directory
from tests.distributed import async_save_workers
from tests.distributed.harness import run_distributed

WRITE_S = 2.0  # the slowed writer's extra time: far beyond what planning and forking cost


def test_an_async_save_returns_before_its_write_and_resumes_like_a_sync_save(tmp_path) -> None:
    """TP=2 with the distributed optimizer: an update runs while the write is under way, and the published
    checkpoint still holds the state it was taken at — the next update from it equals the uninterrupted one and the
    synchronous checkpoint's, bit for bit; it is the third save through Megatron's cached plans, whose first save
    of each structure alone is validated (the one before any update has no optimizer state)."""
    reports = run_distributed(async_save_workers.async_save_resumes_like_a_sync_save, 2, str(tmp_path), WRITE_S)
    for rank, report in enumerate(reports):
        assert report["validated"] == [True, True, False, False], (rank, report["validated"])
        # returned while this rank's writer was still at work, long before the write was seen done
        assert report["writing_on_return"], rank
        assert report["returned_s"] < report["timing"].write_s - WRITE_S / 2, (rank, report["returned_s"])
        assert report["while_pending"] == {"published": False, "latest": None, "poll": None}, report
        timing = report["timing"]
        assert timing.asynchronous and timing.step == 2 and timing.write_s >= WRITE_S, timing
        assert report["latest"] == tmp_path / "async" / "step_2"
        for kind in ("async", "sync"):
            update, weight_difference = report["resumed"][kind]
            assert update == report["uninterrupted"], (kind, rank, update, report["uninterrupted"])
            assert weight_difference == 0.0, (kind, rank, weight_difference)
            # a write failing on one rank (async: rank 1's writer; sync: rank 0's manifest) is one CheckpointError
            # on every rank (none waits for the failed one), the partial save removed, `latest` where it was
            error, partial_left, latest = report["failures"][kind]
            assert error is not None and "could not be written" in error, (kind, rank, error)
            assert not partial_left and latest == tmp_path / kind / "step_2", (kind, rank, latest)
        assert "rank 1" in reports[0]["failures"]["async"][0], reports[0]["failures"]["async"][0]
        assert "Is a directory" in reports[0]["failures"]["sync"][0], reports[0]["failures"]["sync"][0]


def test_the_next_save_a_rollback_and_a_stop_wait_for_the_pending_save_and_pruning_spares_it(tmp_path) -> None:
    report = run_distributed(async_save_workers.keeper_waits_for_pending_saves, 1, str(tmp_path))[0]
    # saving step 3 published step 2 first; step 3 is then the one pending
    assert report["pending_after_save_3"] == 3
    assert report["published_before_save_3"] == ["step_1", "step_2"]
    # the rollback's target is step 3, the good checkpoint, published for it: nothing left pending
    assert report["rollback_target"] == ("step_3", None)
    # keep=2 pruned step_1 and step_2 at step 4's publication, never the pending step 5
    assert report["while_5_pending"] == [".tmp_step_5", "step_3", "step_4"]
    assert report["resumable_while_5_pending"] == "step_4"
    assert report["stop"].startswith(f"the good checkpoint left is {tmp_path}/step_5"), report["stop"]
    assert report["after_stop"] == (["step_4", "step_5"], "step_5", None)
    assert report["after_close"] == ("step_6", None)  # the trainer's close publishes a pending save
    # a publication sets what it prunes aside, and the next save's writer deletes it (not the training loop)
    assert report["set_aside_after_stop"] == ["step_3"], report["set_aside_after_stop"]
    assert report["set_aside_after_close"] == [], "the close deletes what the last publications set aside"
    # judged good, marked once published (step 2 while it was pending: marked at its publication)
    assert report["marked_before_save_3"] == ["step_1", "step_2"]
    assert report["marked"] == ["step_5"], "of those kept (keep=2: step_5, step_6), the one judged"
    # a resume from a checkpoint judged good holds it good at once; an unjudged one waits for the next iteration
    assert report["resumed"] == {"step_5": ("step_5", None), "step_6": ("step_5", "step_6")}


def test_a_job_killed_mid_write_resumes_from_the_previous_published_checkpoint(tmp_path) -> None:
    """SIGKILL (the job and its writer) after step 2's shards are written, before its publication."""

    def killed_while_writing(port: int) -> None:
        """The job on `port`, killed once it says it is writing (an AssertionError with its output otherwise: on a
        port another test took first, `on_a_free_port` launches it again on another)."""
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "MASTER_PORT": str(port)}
        job = subprocess.Popen([sys.executable, "-m", "tests.distributed.async_save_workers", str(tmp_path)],
                               cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)  # fmt: skip
        try:
            lines = []
            for line in job.stdout:
                lines.append(line)
                if line.strip() == "writing":
                    break
            assert lines and lines[-1].strip() == "writing", "".join(lines)[-3000:]
        finally:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()

    on_a_free_port(killed_while_writing)
    assert any((tmp_path / ".tmp_step_2").glob("*.distcp")), "the kill must come while step 2 is being written"
    assert directory.named_by_latest(tmp_path) == tmp_path / "step_1"
    assert directory.find_resumable(tmp_path) == tmp_path / "step_1"
    assert torch.load(tmp_path / "step_1" / directory.TRAINER_STATE, weights_only=True)["step"] == 1


def test_the_save_plan_leaves_out_the_cpu_device_mode_and_only_it(tmp_path) -> None:
    """`without_device_mode` (an asynchronous save's build and plan, `store.save_checkpoint`): inside it a CUDA
    placement fails as on any machine without CUDA, instead of being moved to the CPU; the mode is back after it,
    and under another torch-function mode it leaves both in place."""
    report = run_distributed(async_save_workers.device_mode_left_out, 1)[0]
    assert report == {"outside": "cpu", "inside": "refused", "after": "cpu", "under_another_mode": "cpu",
                      "the_other_mode_saw": "zeros"}, report  # fmt: skip
