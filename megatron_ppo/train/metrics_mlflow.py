"""MLflow as a logger (`trainer.logger: [..., mlflow]`, verl's meaning): the run's scalars, config, events, figure and
summary in one MLflow run, written by global rank 0 through `MetricsLogger`.

Where: MLflow's own settings. The server is `MLFLOW_TRACKING_URI` (unset: MLflow's default store); the experiment
`MLFLOW_EXPERIMENT_ID`, else `MLFLOW_EXPERIMENT_NAME`, else `trainer.project_name` (verl's); the MLflow run's name is
`trainer.experiment_name` (verl's); `MLFLOW_RUN_ID` logs into that run (as verl does, for platforms that start it).
No config key of our own: verl has none, and NeMo-RL's (`logger.mlflow.experiment_name`, `run_name`, `tracking_uri`)
are what `trainer.project_name`, `trainer.experiment_name` and `MLFLOW_TRACKING_URI` already say.

What: every scalar under its TensorBoard name at its step (a name with characters MLflow refuses has them replaced by
`_`, as verl does); the resolved config as parameters (dotted keys as in overrides, values as JSON, cut to MLflow's
6000 characters with a closing `…`: the whole config is the artifact `config.yaml`) and the recipe file as given
to `train` under `recipe/`; each job's events (`MetricsLogger.event`) as `events/<job start>.txt` at its end; at
each job's end the run's figure (`run.png`, `report --plot`, with the plot extra) and summary (`summary.txt`,
`report`), both drawn from the TensorBoard folder once it is closed and so only with `tensorboard` on (the command
line adds them after the job, `runs/tracking.py`, into the MLflow run `finished_run` names); tags `megatron_ppo.run_id`,
`megatron_ppo.recipe`, `megatron_ppo.command`, `megatron_ppo.layout` and MLflow's `mlflow.source.git.commit`.

One run across jobs: the MLflow run's id is kept in the run's log folder (`mlflow.json`, beside `run.json`), so a
resumed job (Ctrl-C, requeue, crash) continues it; a new run (a new run id and log folder) is a new MLflow run.
Parameters cannot change: a job that changes a per-job key (`trainer.total_training_steps`, …) keeps the first
job's parameter (its own value is in its `config.yaml`). A job ends the MLflow run FINISHED at the run's last step,
KILLED before it (the next job sets it RUNNING). Rollbacks: the steps a rollback replays are logged again, and
MLflow keeps every value of a metric's history with its time (`get_metric_history`): nothing is overwritten, the
later value of a step is the replay's; `guard/rollback` marks each rollback's step, the tag `megatron_ppo.rollbacks`
lists them.

Never in the way: a server an HTTP probe cannot reach in `PROBE_TIMEOUT_S`, or any failure to start, is one warning
line and the job goes on without MLflow; a failure later (the server gone mid-run) is one more line and the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from itertools import batched
from pathlib import Path
from typing import Any

from megatron_ppo.checkpoint.run_identity import flatten_config
from megatron_ppo.config.layout import data_parallel_size, world_size
from megatron_ppo.config.schema import PPOConfig

MLFLOW_FILE = "mlflow.json"  # in the run's log folder: the MLflow run a resumed job continues
MLFLOW_EXTRA = "pip install 'megatron-ppo[mlflow]'"
PROBE_TIMEOUT_S = 5.0
# MLflow's limits (mlflow.utils.validation; tests/unit/test_mlflow_logger.py checks them against it)
MAX_PARAM_VALUE = 6000
MAX_TAG_VALUE = 8000
MAX_KEY = 250
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
CUT = "…"
ROLLBACK_METRIC = "guard/rollback"  # logged at each rollback's step (train/guard_responses.py)
ROLLBACKS_TAG = "megatron_ppo.rollbacks"  # the steps of the run's rollbacks, every job's
INVALID_KEY_CHARACTERS = re.compile(r"[^/\w.\- :]")  # MLflow's metric names: what verl's adapter replaces


def cut(text: str, limit: int) -> str:
    """`text`, or its first `limit` characters ending in `CUT` when it is longer."""
    return text if len(text) <= limit else text[: limit - len(CUT)] + CUT


def config_params(config: PPOConfig) -> dict[str, str]:
    """The resolved config as MLflow parameters: dotted keys (`flatten_config`), strings as written and every other
    value as JSON (lists whole: `["console", "mlflow"]`), each within MLflow's limits."""
    return {
        cut(key, MAX_KEY): cut(value if isinstance(value, str) else json.dumps(value), MAX_PARAM_VALUE)
        for key, value in flatten_config(config).items()
    }


def metric_name(tag: str) -> str:
    """`tag` as MLflow accepts it: characters it refuses replaced by `_`, runs of `/` made one (as verl does)."""
    return INVALID_KEY_CHARACTERS.sub("_", re.sub("/+", "/", tag))


def describe_layout(config: PPOConfig) -> str:
    """The job's processes and the actor's parallel layout, e.g. `2 cpu processes: TP2 PP1 CP1 EP1 DP1`."""
    layout = config.actor.megatron
    return (
        f"{world_size(config)} {config.cluster.device} processes: TP{layout.tensor_model_parallel_size} "
        f"PP{layout.pipeline_model_parallel_size} CP{layout.context_parallel_size} "
        f"EP{layout.expert_model_parallel_size} DP{data_parallel_size(config, layout)}"
    )


def launched_recipe(argv: Sequence[str]) -> Path | None:
    """The recipe file of a `megatron_ppo train RECIPE ...` command line (`sys.argv`), None for any other."""
    if len(argv) > 2 and argv[1] == "train" and Path(argv[2]).is_file():
        return Path(argv[2])
    return None


def git_commit() -> str | None:
    """The commit of the checkout the package runs from, None when it is not one (an installed wheel)."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / ".git").exists():
        return None
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=10,
                                check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return result.stdout.strip() if result.returncode == 0 else None


def run_tags(config: PPOConfig, run_id: str, argv: Sequence[str]) -> dict[str, str]:
    """The tags each job sets on the MLflow run (a later job's layout or commit replaces the earlier's)."""
    tags = {"megatron_ppo.run_id": run_id, "megatron_ppo.layout": describe_layout(config)}
    recipe = launched_recipe(argv)
    if recipe is not None:
        tags["megatron_ppo.recipe"] = str(recipe)
        tags["megatron_ppo.command"] = shlex.join(["megatron_ppo", *argv[1:]])
    commit = git_commit()
    if commit is not None:
        tags["mlflow.source.git.commit"] = commit
    return {key: cut(value, MAX_TAG_VALUE) for key, value in tags.items()}


def unreachable(tracking_uri: str) -> str | None:
    """Why an HTTP(S) tracking server cannot be reached (None when it answers, with any status, or the store is not
    a server): one request with a short timeout, so that MLflow's own retries (minutes) never hold the start."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    import requests

    try:
        requests.get(f"{tracking_uri.rstrip('/')}/health", timeout=PROBE_TIMEOUT_S)
    except requests.RequestException as error:
        return f"{type(error).__name__}: {error}"
    return None


def warn(message: str) -> None:
    """One warning line on stderr (a multi-line error folded into it), whatever `trainer.logger` says."""
    print(f"warning: MLflow: {' '.join(message.split())}", file=sys.stderr, flush=True)


class MlflowLogger:
    """One job's writes to the run's MLflow run (module docstring). `start` makes it, or warns and gives None."""

    def __init__(self, client: Any, mlflow_run_id: str, total_steps: int) -> None:
        self.client = client
        self.run_id = mlflow_run_id
        self.total_steps = total_steps
        self.job = datetime.now(UTC).strftime("%Y%m%d-%H%M%S.%f")[:-3]  # this job's events file: its start, to the ms
        self.events: list[str] = []
        self.rollbacks: list[str] = []  # the steps of the run's rollbacks, earlier jobs' first
        self.last_step = 0
        self.failed = False

    @classmethod
    def start(cls, log_dir: Path, config: PPOConfig, run_id: str, total_steps: int) -> MlflowLogger | None:
        """Start or continue the MLflow run of the run `run_id` (its log folder `log_dir`) and log the config; None,
        after one warning line, when MLflow cannot be reached or refuses."""
        try:
            import mlflow
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise RuntimeError(
                f"trainer.logger includes mlflow, but mlflow is not installed; install the extra ({MLFLOW_EXTRA}) "
                "or drop mlflow from trainer.logger"
            ) from None
        tracking_uri = mlflow.get_tracking_uri()
        reason = unreachable(tracking_uri)
        if reason is not None:
            warn(f"the tracking server {tracking_uri} is unreachable ({reason}); this job goes on without MLflow")
            return None
        try:
            client = MlflowClient(tracking_uri)
            mlflow_run_id = _continued_run(client, log_dir, tracking_uri) or _new_run(client, config)
            (log_dir / MLFLOW_FILE).write_text(json.dumps({"tracking_uri": tracking_uri, "run_id": mlflow_run_id}))
            logger = cls(client, mlflow_run_id, total_steps)
            logger.log_config(config, run_id)
        except Exception as error:  # whatever the store says, training goes on
            unset = "" if os.environ.get("MLFLOW_TRACKING_URI") else " (MLFLOW_TRACKING_URI is unset: MLflow's default)"
            warn(f"could not start logging to {tracking_uri}{unset} ({type(error).__name__}: {error}); this job goes "
                 "on without MLflow")  # fmt: skip
            return None
        return logger

    def log_config(self, config: PPOConfig, run_id: str) -> None:
        """This job's tags, the parameters the run does not have yet, the resolved config and the recipe file; the
        rollbacks earlier jobs tagged."""
        from mlflow.entities import Param, RunTag

        tags = run_tags(config, run_id, sys.argv)
        self.client.log_batch(self.run_id, tags=[RunTag(key, value) for key, value in tags.items()])
        run = self.client.get_run(self.run_id)
        earlier_rollbacks = run.data.tags.get(ROLLBACKS_TAG)
        self.rollbacks = earlier_rollbacks.split(", ") if earlier_rollbacks else []
        new = [Param(key, value) for key, value in config_params(config).items() if key not in run.data.params]
        for batch in batched(new, MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=list(batch))
        self.client.log_dict(self.run_id, dataclasses.asdict(config), "config.yaml")
        recipe = launched_recipe(sys.argv)
        if recipe is not None:
            self.client.log_artifact(self.run_id, str(recipe), "recipe")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """The scalars of `step`, stamped now (a step logged again after a rollback is a later entry of its
        history)."""
        from mlflow.entities import Metric, RunTag

        self.last_step = max(self.last_step, step)
        now = int(time.time() * 1000)
        entries = [Metric(metric_name(tag), float(value), now, step) for tag, value in metrics.items()]
        tags = []
        if ROLLBACK_METRIC in metrics:
            self.rollbacks.append(str(step))
            tags = [RunTag(ROLLBACKS_TAG, cut(", ".join(self.rollbacks), MAX_TAG_VALUE))]
        self._guarded(f"step {step}", lambda: self._log_batch(entries, tags))

    def _log_batch(self, entries: list[Any], tags: list[Any]) -> None:
        for batch in batched(entries, MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=list(batch))
        if tags:
            self.client.log_batch(self.run_id, tags=tags)

    def event(self, step: int, tag: str, message: str) -> None:
        """Kept for this job's `events/<job start>.txt`, written at its end."""
        self.last_step = max(self.last_step, step)
        self.events.append(f"step {step}\t{tag}\t{message}")

    def close(self) -> None:
        """This job's events and the MLflow run's status: FINISHED at the run's last step, KILLED before it. A job
        whose writes all went through is then `finished_run`, for the run's report to be added to."""
        self._guarded("the job's end", self._close)
        if not self.failed:
            _finished.append(self)

    def _close(self) -> None:
        if self.events:
            self.client.log_text(self.run_id, "\n".join(self.events) + "\n", f"events/{self.job}.txt")
        self.client.set_terminated(self.run_id, "FINISHED" if self.last_step >= self.total_steps else "KILLED")

    def _guarded(self, when: str, write: Any) -> None:
        """`write()`, unless an earlier write failed; a failure is one warning line and ends MLflow for this job."""
        if self.failed:
            return
        try:
            write()
        except Exception as error:  # a tracking server going away never stops training
            self.failed = True
            warn(f"logging failed at {when} ({type(error).__name__}: {error}); this job goes on without MLflow")


def _continued_run(client: Any, log_dir: Path, tracking_uri: str) -> str | None:
    """The MLflow run to log into: `MLFLOW_RUN_ID`, else the one this run's earlier jobs kept in `log_dir` on the
    same tracking server (set RUNNING again); None for a new one."""
    from mlflow.environment_variables import MLFLOW_RUN_ID

    chosen = MLFLOW_RUN_ID.get()
    saved = log_dir / MLFLOW_FILE
    if chosen is None and saved.is_file():
        kept = json.loads(saved.read_text())
        chosen = kept["run_id"] if kept.get("tracking_uri") == tracking_uri else None
    if chosen is not None:
        client.update_run(chosen, status="RUNNING")
    return chosen


def _new_run(client: Any, config: PPOConfig) -> str:
    """A new MLflow run named `trainer.experiment_name` in the experiment MLflow's settings name, else in
    `trainer.project_name` (created when missing)."""
    from mlflow.environment_variables import MLFLOW_EXPERIMENT_ID, MLFLOW_EXPERIMENT_NAME
    from mlflow.exceptions import MlflowException

    experiment_id = MLFLOW_EXPERIMENT_ID.get()
    if experiment_id is None:
        name = MLFLOW_EXPERIMENT_NAME.get() or config.trainer.project_name
        experiment = client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            try:
                experiment_id = client.create_experiment(name)
            except MlflowException:  # another run created it meanwhile
                experiment_id = client.get_experiment_by_name(name).experiment_id
    return client.create_run(experiment_id, run_name=config.trainer.experiment_name).info.run_id


_finished: list[MlflowLogger] = []  # this process's jobs that logged to MLflow to their end


def finished_run() -> MlflowLogger | None:
    """The MLflow logger of this process's last job, when every write of it went through (its client and run id,
    for the run's report: `runs/tracking.py`); None when MLflow was off, unreachable or failed."""
    return _finished[-1] if _finished else None
