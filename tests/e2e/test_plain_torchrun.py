"""Plain `torchrun`, still what many users type, tells what happened: it SIGTERMs every other worker as soon as one
exits, so the order in which ranks meet an error must not change the story. A config error every rank meets is one
`error:` block even when rank 0 meets it last (before: rank 0 was stopped in its set-up and the error never appeared,
or it claimed a preemption); a rank stopped by torchrun in its set-up after a peer failed says so, not "requeued"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.tiny import RECIPE, REPO
from tests.faults.cases import QUICK

pytestmark = pytest.mark.e2e


def _torchrun(mode: str, *overrides: str, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("MASTER_PORT", None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
               "tests.support.torchrun_worker", mode, "train", str(RECIPE), *overrides,
               f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/tb"]  # fmt: skip
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_a_config_error_rank_0_meets_last_is_said_once_and_never_as_a_preemption(tmp_path: Path) -> None:
    done = _torchrun("rank-0-late", "actor.megatron.pipeline_model_parallel_size=4", tmp_path=tmp_path)
    output = done.stdout + done.stderr
    assert output.count("error: 3 config problems") == 1, output
    assert "stopped" not in output and "requeued" not in output, output
    assert output.count("exitcode  : 2") == 2, "both workers exit 2, the error's status"


def test_a_rank_stopped_in_set_up_after_a_peer_failed_says_so_not_requeued(tmp_path: Path) -> None:
    two = [
        *QUICK,
        "cluster.gpus_per_node=2",
        *(f"{role}.ppo_micro_batch_size_per_gpu=8" for role in ("actor", "critic")),
    ]
    done = _torchrun("rank-1-fails", *two, f"data.addition.work_dir={tmp_path}/task", tmp_path=tmp_path)
    output = done.stdout + done.stderr
    assert "stopped by SIGTERM from the launcher before training (another rank failed first?" in output, output
    assert "requeued" not in output and "this is a bug" not in output, output
