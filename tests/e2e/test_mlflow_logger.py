"""MLflow beside TensorBoard through the real CLI (one process, the quick tiny run): a run of two jobs (the first
stops at its job budget, the second resumes), then a second run in the same experiment that a KL threshold every
update exceeds rolls back once (and then stops), all logging to a real MLflow store read back with `MlflowClient`;
and a run whose tracking server is unreachable.

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
from typing import Any

import pytest

from bench.ports import free_port, on_a_free_port
from bench.tiny import RECIPE, REPO
from megatron_ppo.config import load_config
from megatron_ppo.runs.report import load_run
from megatron_ppo.train.metrics_mlflow import MLFLOW_FILE, config_params, git_commit
from tests.faults.cases import QUICK

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
    """`python -m megatron_ppo train RECIPE ARGUMENTS` in one process logging to `tracking_uri`, which must exit
    with `status`; its output."""

    def launch(port: int) -> int:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MASTER_PORT": str(port),
               "COLUMNS": "1000", "MLFLOW_TRACKING_URI": tracking_uri, "MLFLOW_ALLOW_FILE_STORE": "true"}  # fmt: skip
        for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
            env.pop(name, None)
        with log.open("w") as out:
            return subprocess.run([sys.executable, "-m", "megatron_ppo", "train", str(RECIPE), *arguments], cwd=REPO,
                                  env=env, stdout=out, stderr=subprocess.STDOUT, timeout=900).returncode  # fmt: skip

    exited = on_a_free_port(launch, log=lambda exited: log.read_text() if exited else "")
    assert exited == status, f"training exited {exited}; log tail:\n{log.read_text()[-4000:]}"
    return log.read_text()


def assert_same_scalars(client: Any, mlflow_run: Any, tensorboard_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard holds of a run is in its MLflow run under the same name, with the same values at the
    same steps, each write of a step (a rollback's replay too) once; TensorBoard's writes, by tag (step, value)."""
    writes = {tag: sorted((step, value) for _, step, value in w) for tag, w in load_run(tensorboard_dir).writes.items()}
    assert sorted(mlflow_run.data.metrics) == sorted(writes), "MLflow and TensorBoard name other metrics"
    for tag, written in writes.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, tag))
        assert [step for step, _ in history] == [step for step, _ in written], f"{tag}: other steps"
        assert [value for _, value in history] == pytest.approx(
            [value for _, value in written], rel=1e-6, abs=1e-6, nan_ok=True
        )
    return writes


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
    # the actor updates from step 3 on (critic_warmup): step 1's save is good once step 2 passed, and step 3's KL
    # rolls back into it; step 2 is replayed, step 3 fires again, and with max_rollbacks=1 that is a guard stop (3)
    run_b = overrides(tmp_path / "b", work, ["trainer.total_training_steps=3", "trainer.resume_mode=disable",
                                             "guards.kl_explosion_threshold=1e-9", "trainer.critic_warmup=2",
                                             "trainer.save_freq=1", "guards.max_rollbacks=1"])  # fmt: skip
    train(run_b, store, tmp_path / "b.log", status=3)

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    found = {run.data.tags["megatron_ppo.run_id"]: run for run in client.search_runs([experiment.experiment_id])}
    folders = {name: next((tmp_path / name / "tb").iterdir()) for name in ("a", "b")}
    assert sorted(found) == sorted(folder.name for folder in folders.values()), "one MLflow run for each run"
    mlflow_run = found[folders["a"].name]
    run_id = mlflow_run.info.run_id
    assert (folders["a"] / MLFLOW_FILE).is_file() and run_id in (folders["a"] / MLFLOW_FILE).read_text()
    assert mlflow_run.info.status == "FINISHED" and mlflow_run.info.run_name == "tiny"

    tensorboard = assert_same_scalars(client, mlflow_run, folders["a"])
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

    rolled_back = found[folders["b"].name]
    assert rolled_back.info.run_id != run_id, "the second run is a new MLflow run"
    replayed = assert_same_scalars(client, rolled_back, folders["b"])
    assert replayed["guard/rollback"] == [(3, 1.0)] and rolled_back.data.tags["megatron_ppo.rollbacks"] == "3"
    steps = [step for step, _ in replayed["reward/mean"]]
    assert steps == [1, 2, 2, 3], f"the replayed step 2 is logged again beside its first value: {steps}"


def test_an_unreachable_tracking_server_is_one_warning_and_the_run_finishes(tmp_path: Path, work: Path) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    output = train(overrides(tmp_path, work, ["trainer.total_training_steps=2", "trainer.resume_mode=disable"]),
                   closed, tmp_path / "train.log")  # fmt: skip
    warnings = [line for line in output.splitlines() if "MLflow" in line]
    assert len(warnings) == 1 and f"the tracking server {closed} is unreachable" in warnings[0], warnings
    assert {step for _, step, _ in load_run(tmp_path / "tb").writes["actor/pg_loss"]} == {1, 2}
