"""MLflow beside TensorBoard through the real CLI (one process, the quick tiny run): a run of two jobs (the first
stops at its job budget, the second resumes), logging to a real MLflow store read back with `MlflowClient`; and a
run whose tracking server is unreachable. A rollback's replayed steps and a second run of the experiment are
tested through the logger itself (`tests/unit/test_mlflow_logger.py`): the trainer's writes around a rollback are
TensorBoard's (the fault drill reads them back), and the logger sends MLflow the same.

The store is MLflow's file store (`file://`, with `MLFLOW_ALLOW_FILE_STORE=true`): the package's extra is
mlflow-skinny, the tracking client without the server or the SQLAlchemy store, because the full `mlflow` pins
pyarrow below the version the lock holds. The client writes through the same `MlflowClient` calls to any store; the
HTTP path (`RestStore`) is what the unreachable-server test goes through."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ports import free_port
from bench.tiny import RECIPE, REPO
from megatron_ppo.config import load_config
from megatron_ppo.runs.report import load_run
from megatron_ppo.train.metrics_mlflow import MLFLOW_FILE, config_params, git_commit
from tests.faults.cases import QUICK
from tests.support.mlflow_store import assert_same_scalars

EXPERIMENT = "mlflow_e2e"
LOGGERS = "trainer.logger=[console,tensorboard,mlflow]"


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """The quick run's task cache (tokenizer, SFT start, rows), built by the first launch and shared."""
    return tmp_path_factory.mktemp("mlflow-work")


def overrides(folder: Path, work: Path, extra: list[str]) -> list[str]:
    return [*QUICK, f"data.addition.work_dir={work}", f"trainer.default_local_dir={folder}/ckpt",
            f"trainer.log_dir={folder}/tb", LOGGERS, f"trainer.project_name={EXPERIMENT}",
            "trainer.experiment_name=tiny", *extra]  # fmt: skip


def train(arguments: list[str], tracking_uri: str, log: Path, status: int = 0) -> str:
    """`python -m megatron_ppo train RECIPE ARGUMENTS` in one process (its rendezvous on a port the OS picks) logging
    to `tracking_uri`, which must exit with `status`; its output."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "1000",
           "MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_ALLOW_FILE_STORE": "true"}  # fmt: skip
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MASTER_PORT"):
        env.pop(name, None)
    with log.open("w") as out:
        exited = subprocess.run([sys.executable, "-m", "megatron_ppo", "train", str(RECIPE), *arguments], cwd=REPO,
                                env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode  # fmt: skip
    assert exited == status, f"training exited {exited}; log tail:\n{log.read_text()[-4000:]}"
    return log.read_text()


def test_mlflow_holds_every_tensorboard_scalar_the_config_and_the_artifacts_of_one_run_across_a_resume(
    tmp_path: Path, work: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    store = f"file://{tmp_path}/mlruns"
    run_a = overrides(tmp_path / "a", work, ["trainer.total_training_steps=4", "trainer.save_freq=2",
                                             "trainer.test_freq=2", "trainer.val_before_train=true"])  # fmt: skip
    first = train([*run_a, "trainer.exit_interval=2", "trainer.resume_mode=disable"], store, tmp_path / "a1.log")
    assert "job budget" in first, "the first job should stop after its two steps"
    train([*run_a, "trainer.resume_mode=auto"], store, tmp_path / "a2.log")

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    (folder,) = (tmp_path / "a" / "tb").iterdir()
    assert mlflow_run.data.tags["megatron_ppo.run_id"] == folder.name, "one MLflow run for the run's two jobs"
    run_id = mlflow_run.info.run_id
    assert (folder / MLFLOW_FILE).is_file() and run_id in (folder / MLFLOW_FILE).read_text()
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "tiny"

    tensorboard = assert_same_scalars(client, mlflow_run, folder)
    assert {"actor/pg_loss", "kl/coef", "kl/target", "eval/reward_mean"} <= tensorboard.keys()
    assert [step for step, _ in tensorboard["actor/pg_loss"]] == [1, 2, 3, 4], "each step once across the resume"

    first_job = load_config(RECIPE, [*run_a, "trainer.exit_interval=2", "trainer.resume_mode=disable"])
    assert mlflow_run.data.params == config_params(first_job), "the parameters are the first job's config"
    tags = mlflow_run.data.tags
    assert tags["megatron_ppo.layout"] == "1 cpu processes: TP1 PP1 CP1 EP1 DP1"
    assert tags["megatron_ppo.recipe"] == str(RECIPE) and "trainer.resume_mode=auto" in tags["megatron_ppo.command"]
    commit = tags["mlflow.source.git.commit"]  # HEAD then; the checkout may have moved on since (a commit beside us)
    ancestry = ["git", "merge-base", "--is-ancestor", commit, git_commit() or "HEAD"]
    assert re.fullmatch("[0-9a-f]{40}", commit) and subprocess.run(ancestry, cwd=REPO, check=False).returncode == 0

    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"config.yaml", "recipe", "events", "summary.txt", "run.png"} <= artifacts, artifacts
    assert [a.path for a in client.list_artifacts(run_id, "recipe")] == [f"recipe/{RECIPE.name}"]
    events = client.list_artifacts(run_id, "events")
    assert len(events) == 2, "one events file for each job"
    local = Path(client.download_artifacts(run_id, "summary.txt", str(tmp_path / "down")))
    assert "actor/pg_loss" in local.read_text()


def test_an_unreachable_tracking_server_is_one_warning_and_the_run_finishes(tmp_path: Path, work: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    output = train(overrides(tmp_path, work, ["trainer.total_training_steps=2", "trainer.resume_mode=disable"]),
                   closed, tmp_path / "train.log")  # fmt: skip
    warnings = [line for line in output.splitlines() if "MLflow" in line]
    assert len(warnings) == 1 and f"the tracking server {closed} is unreachable" in warnings[0], warnings
    assert {step for _, step, _ in load_run(tmp_path / "tb").writes["actor/pg_loss"]} == {1, 2}
