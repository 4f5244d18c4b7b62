"""The MLflow logger's pieces against MLflow itself: its limits, the config as parameters a real store accepts and
gives back, metric names, the reachability probe, the config checks, a run's rollbacks and jobs through
`MetricsLogger` into a real store, and that nothing imports mlflow unless asked."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.ports import free_port
from bench.tiny import RECIPE
from megatron_ppo.checkpoint.run_identity import flatten_config, new_run_id
from megatron_ppo.config import load_config
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.train import metrics_mlflow
from megatron_ppo.train.metrics import MetricsLogger
from megatron_ppo.train.metrics_mlflow import config_params, cut, metric_name, unreachable
from tests.support.mlflow_store import assert_same_scalars


def test_the_limits_are_mlflows_own() -> None:
    from mlflow.utils import validation

    assert (metrics_mlflow.MAX_PARAM_VALUE, metrics_mlflow.MAX_TAG_VALUE, metrics_mlflow.MAX_KEY) == (
        validation.MAX_PARAM_VAL_LENGTH, validation.MAX_TAG_VAL_LENGTH, validation.MAX_ENTITY_KEY_LENGTH,
    )  # fmt: skip
    assert (metrics_mlflow.MAX_PARAMS_PER_BATCH, metrics_mlflow.MAX_METRICS_PER_BATCH) == (
        validation.MAX_PARAMS_TAGS_PER_BATCH, validation.MAX_METRICS_PER_BATCH,
    )  # fmt: skip


def test_the_config_as_parameters_is_accepted_and_read_back_by_a_real_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    long_path = "x" * 7000
    config = load_config(RECIPE, ["trainer.logger=[console,mlflow]", f"trainer.project_name={long_path}"])
    params = config_params(config)
    assert params.keys() == flatten_config(config).keys(), "one parameter per dotted key, as overrides name them"
    assert params["trainer.logger"] == '["console", "mlflow"]' and params["data.train_batch_size"] == "512"
    assert params["trainer.project_name"] == "x" * 5999 + "…"

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(f"file://{tmp_path}/mlruns")
    run = client.create_run(client.create_experiment("params"))
    items = [Param(key, value) for key, value in params.items()]
    for start in range(0, len(items), metrics_mlflow.MAX_PARAMS_PER_BATCH):
        client.log_batch(run.info.run_id, params=items[start : start + metrics_mlflow.MAX_PARAMS_PER_BATCH])
    assert client.get_run(run.info.run_id).data.params == params


def test_cut_keeps_short_text_and_marks_what_it_cuts() -> None:
    assert cut("abc", 3) == "abc"
    assert cut("abcd", 3) == "ab…"


def test_metric_names_keep_tensorboard_tags_and_replace_what_mlflow_refuses() -> None:
    for tag in ("actor/pg_loss", "kl/coef", "eval/reward_mean", "perf/tokens_per_s", "guard/rollback"):
        assert metric_name(tag) == tag
    assert metric_name("eval//acc@1 (top)") == "eval/acc_1 _top_"


def test_an_unreachable_server_is_found_at_once_and_a_store_that_is_no_server_is_not_probed() -> None:
    started = time.monotonic()
    reason = unreachable(f"http://127.0.0.1:{free_port()}")
    assert reason is not None and "ConnectionError" in reason
    assert time.monotonic() - started < metrics_mlflow.PROBE_TIMEOUT_S
    assert unreachable("sqlite:///mlflow.db") is None and unreachable("file:///tmp/mlruns") is None


def test_validate_takes_mlflow_and_refuses_a_misspelled_logger_with_the_names() -> None:
    assert load_config(RECIPE, ["trainer.logger=[console,mlflow]"]).trainer.logger == ["console", "mlflow"]
    with pytest.raises(
        ConfigError, match=r"unknown \['mlfow'\]; use any of 'console', 'tensorboard', 'wandb', 'mlflow'"
    ):
        load_config(RECIPE, ["trainer.logger=[console,mlfow]"])


def test_mlflow_is_imported_only_when_asked_for() -> None:
    code = "import sys, megatron_ppo.train.metrics, megatron_ppo.cli; sys.exit('mlflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_rollbacks_replay_into_the_metric_history_across_jobs_and_a_second_run_is_a_new_mlflow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer's writes around two rollbacks (a guard fires at a step: its event and `guard/rollback`, then the
    steps since the good checkpoint are logged again), over two jobs of one run, through `MetricsLogger` to
    TensorBoard and a real MLflow store: every write is in the metric's history, the tag names both rollbacks'
    steps, the second job continues the MLflow run; a second run in the experiment is a new MLflow run."""
    from mlflow.tracking import MlflowClient

    store = f"file://{tmp_path}/mlruns"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for name in ("MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    config = load_config(RECIPE, ["trainer.logger=[tensorboard,mlflow]", "trainer.project_name=rollbacks"])
    loggers = ["tensorboard", "mlflow"]
    first, second = new_run_id(1_000_000_000), new_run_id(1_000_000_100)

    def job(run_id: str, writes: list[tuple[int, dict[str, float]]]) -> None:
        logger = MetricsLogger(tmp_path / run_id, loggers, total_steps=4, config=config, run_id=run_id)
        for step, metrics in writes:
            if "guard/rollback" in metrics:
                logger.event(step, "guard/rollback", "rolled back")
            logger.log(step, metrics)
        logger.close()

    def reward(step: int, replay: int = 0) -> tuple[int, dict[str, float]]:
        return step, {"reward/mean": step + 0.5 * replay, "actor/pg_loss": -0.01 * step}

    job(first, [reward(1), reward(2), (3, {"guard/rollback": 1.0}), reward(2, replay=1)])
    job(first, [reward(3), (4, {"guard/rollback": 2.0}), reward(3, replay=1), reward(4)])
    job(second, [reward(1)])

    client = MlflowClient(store)
    experiment = client.get_experiment_by_name("rollbacks")
    found = {run.data.tags["megatron_ppo.run_id"]: run for run in client.search_runs([experiment.experiment_id])}
    assert sorted(found) == [first, second] and found[first].info.run_id != found[second].info.run_id
    rolled_back = found[first]
    assert rolled_back.info.status == "FINISHED", "the second job reached the run's last step"
    logged = assert_same_scalars(client, rolled_back, tmp_path / first)
    assert logged["guard/rollback"] == [(3, 1.0), (4, 2.0)]
    assert rolled_back.data.tags[metrics_mlflow.ROLLBACKS_TAG] == "3, 4", "the first job's rollback is kept"
    history = [(m.step, m.value) for m in client.get_metric_history(rolled_back.info.run_id, "reward/mean")]
    assert sorted(history) == [(1, 1.0), (2, 2.0), (2, 2.5), (3, 3.0), (3, 3.5), (4, 4.0)], "no value overwritten"
    assert len(client.list_artifacts(rolled_back.info.run_id, "events")) == 2, "one events file for each job"
