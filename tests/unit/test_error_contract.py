"""The command line's one error contract: every error a user can cause reaches them as one `error:` block and exit 2,
nothing lost; anything else is a bug, shown with its traceback and a line saying so.

The first tests walk the package's exception types: each is a `UserError` or one of the internal signals listed
here. The others run the real `main` in this process on cases that end before any process group or model exists
(data, config, conversion inputs, a taken port, report inputs), asserting the exit status, the message and that
nothing was written or changed.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pkgutil
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import megatron_ppo
from bench.ports import free_port, port_taken
from bench.tiny import RECIPE, REPO
from megatron_ppo.cli import BUG, main, run_reporting_errors
from megatron_ppo.config.errors import ConfigError, UserError
from megatron_ppo.data.tokenizer import train_char_tokenizer

# Exceptions of the package that are not the user's to fix: signals between its own parts, caught before the CLI
INTERNAL = {
    "BadRow": "one row's rejection: `read_rows` turns it into a DataError or a rejects-file line",
    "ScoreError": "a scorer's bad result: rejects the row (BadRow)",
    "TemplateRefused": "a chat template refusing a row's messages: rejects the row (BadRow)",
    "_Unclean": "a batch the column-wise reader leaves to the row parser (`data/columnar.py`): it names bad rows",
    "JobStopped": "preemption, Ctrl-C and job budgets: a checkpoint saved, exit 75 / 130 / 0 (`cli._train`)",
    "Preempted": "a JobStopped",
    "JobBudgetReached": "a JobStopped",
    "Interrupted": "a JobStopped (Ctrl-C in the training loop: exit 130)",
    "StoppedBeforeTraining": "a Preempted (a stop signal during set-up: nothing to save, the marker, exit 75)",
    "GuardStopped": "a guard's stop: its own one line and exit status (`cli.report_guard_stop`)",
}


def _package_exception_types() -> list[type[BaseException]]:
    found = {}
    for module in pkgutil.walk_packages(megatron_ppo.__path__, "megatron_ppo."):
        if module.name.endswith("__main__"):
            continue
        for _, value in inspect.getmembers(importlib.import_module(module.name), inspect.isclass):
            if issubclass(value, BaseException) and value.__module__.startswith("megatron_ppo."):
                found[value.__qualname__] = value
    return sorted(found.values(), key=lambda t: t.__qualname__)


def test_every_error_type_of_the_package_is_the_users_or_an_internal_signal() -> None:
    types = _package_exception_types()
    user = [t.__qualname__ for t in types if issubclass(t, UserError)]
    assert {"ConfigError", "DataError", "CheckpointError", "RunDirectoryLocked", "LaunchError", "PlotError",
            "OutputExistsError", "RunNotFound"} <= set(user), user  # fmt: skip
    unclassified = [t.__qualname__ for t in types if not issubclass(t, UserError) and t.__qualname__ not in INTERNAL]
    assert not unclassified, f"derive these from UserError or list them in INTERNAL with a reason: {unclassified}"


@pytest.mark.parametrize("error_type", [t for t in _package_exception_types() if issubclass(t, UserError)],
                         ids=lambda t: t.__qualname__)  # fmt: skip
def test_each_user_error_type_reaches_the_user_as_one_error_block(error_type, capsys) -> None:
    error = error_type(["the key=value to change"]) if error_type is ConfigError else error_type("what to change")

    def fail(_: argparse.Namespace) -> int:
        raise error

    assert run_reporting_errors(argparse.Namespace(run=fail)) == 2
    err = capsys.readouterr().err
    assert err == f"error: {error}\n", err
    assert "Traceback" not in err


def test_the_troubleshooting_page_names_every_error_a_user_can_meet() -> None:
    page = (Path(megatron_ppo.__file__).parents[1] / "docs" / "troubleshooting.md").read_text()
    user = [t.__qualname__ for t in _package_exception_types() if issubclass(t, UserError) and t is not UserError]
    missing = [name for name in user if f"### `{name}`" not in page]
    assert user and not missing, f"docs/troubleshooting.md has no section on {missing}: what it means, what to do"


def test_a_bug_shows_its_traceback_and_says_it_is_one(capsys) -> None:
    def fail(_: argparse.Namespace) -> int:
        return {}["missing"]

    assert run_reporting_errors(argparse.Namespace(run=fail)) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "KeyError: 'missing'" in err and err.endswith(BUG + "\n")


def _gloo_rank(rank: int, port: int) -> None:
    """Rank 0 of two meets rank 1's death in an all-reduce, through the CLI's error contract; rank 1 leaves."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")

    def run(_: argparse.Namespace) -> int:
        dist.init_process_group("gloo", rank=rank, world_size=2)
        dist.barrier()
        if rank == 1:
            os._exit(9)  # as a SIGKILL: no goodbye to the peer
        time.sleep(1.0)
        dist.all_reduce(torch.ones(1))
        return 0

    sys.exit(run_reporting_errors(argparse.Namespace(run=run)))


def test_a_peer_that_died_is_named_as_such_not_called_a_bug(tmp_path: Path) -> None:
    """Real gloo: what rank 0 says when rank 1 is gone in the middle of a collective (plain torchrun prints it)."""
    port = free_port()
    code = (
        "import sys; from tests.unit.test_error_contract import _gloo_rank; "
        "_gloo_rank(int(sys.argv[1]), int(sys.argv[2]))"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port)], cwd=REPO, env=env,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
    (_, err), _ = ranks[0].communicate(timeout=120), ranks[1].communicate(timeout=120)
    assert ranks[0].returncode == 1, err
    assert "a process of this job died or stopped (" in err and "this one ends with it" in err, err
    assert BUG not in err and "Traceback" not in err, err


# --- cases through `main`, ended before any process group or model -----------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    """A character tokenizer for the digits, '+' and '=' (the tiny model's 16-entry vocabulary): others are unknown."""
    path = tmp_path_factory.mktemp("tokenizer") / "chars.model"
    train_char_tokenizer(["12+34=46", "5+6=11", "7+8=15", "9+0=9"], path)
    return path


def _train_args(tmp_path: Path, tokenizer: Path, data: str | Path, *extra: str) -> list[str]:
    return ["train", str(RECIPE), "data.task=null", f"model.tokenizer={tokenizer}", f"data.train_files=[{data}]",
            "model.allow_random_init=true", "cluster.gpus_per_node=1", "data.train_batch_size=2",
            *(f"{role}.megatron.tensor_model_parallel_size=1" for role in ("actor", "ref", "critic")),
            *(f"{role}.{key}=2" for role in ("actor", "critic")
              for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu")),
            f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/tb", *extra]  # fmt: skip


def _one_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return err[err.index("error:") :]


GOOD = {"prompt": "1+2=", "response": "3", "reward": 1.0}
# (file name, content, what the message must name): every DataError a user's file can cause
DATA_FAULTS = [
    ("bad.jsonl", '{"prompt": "1+2=", "response": ', "bad.jsonl:1: the line is not valid JSON"),
    ("noreward.jsonl", '{"prompt": "1+2=", "response": "3"}', "neither 'reward' nor 'token_rewards'"),
    ("text.jsonl", '{"prompt": "1+2=", "response": "3", "reward": "high"}', "'reward' is a string"),
    ("nan.jsonl", '{"prompt": "1+2=", "response": "3", "reward": NaN}', "'reward' is nan"),
    ("empty_response.jsonl", '{"prompt": "1+2=", "response": "", "reward": 1}', "has no tokens"),
    ("null.jsonl", '{"prompt": "1+2=", "response": null, "reward": 1}', "'response' is null"),
    ("empty.jsonl", "", "no rows left in"),
    ("text.parquet", json.dumps(GOOD), "cannot read it as Parquet"),
    ("ids.jsonl", '{"prompt_ids": [1, 2], "response_ids": [99], "reward": 1}', "response_ids"),
    ("rollout.jsonl", json.dumps(GOOD), "no 'behavior_log_probs'"),
    ("unknown.jsonl", '{"prompt": "1+2=", "response": "three", "reward": 1}', "unknown token"),
    ("scored.jsonl", '{"prompt": "1+2=", "response": "3", "reward_model": {"ground_truth": "3"}}', "could not score"),
]
EXTRA = {
    "rollout.jsonl": ["algorithm.rollout_correction.rollout_is=token"],
    "unknown.jsonl": ["data.tokenization_check=strict"],
    "scored.jsonl": ["reward.score_fn=custom"],
}


@pytest.mark.parametrize(("name", "content", "named"), DATA_FAULTS, ids=[case[0] for case in DATA_FAULTS])
def test_data_faults_end_in_one_line_before_any_model(tmp_path, tokenizer, capsys, name, content, named) -> None:
    data = tmp_path / name
    data.write_text(content + ("\n" if content else ""))
    extra = EXTRA.get(name, [])
    if name == "scored.jsonl":
        scorer = tmp_path / "score.py"
        scorer.write_text("def compute_score(**kwargs):\n    raise RuntimeError('the grader is down')\n")
        extra = [*extra, f"reward.custom_fn.path={scorer}"]
    assert main(_train_args(tmp_path, tokenizer, data, *extra)) == 2
    message = _one_error(capsys)
    assert named in message and str(data) in message, message
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir()), "nothing logged: no run started"
    assert not list((tmp_path / "ckpt").glob("step_*"))


def test_a_missing_data_file_is_named(tmp_path, tokenizer, capsys) -> None:
    assert main(_train_args(tmp_path, tokenizer, tmp_path / "absent.jsonl")) == 2
    assert f"data file {tmp_path}/absent.jsonl does not exist" in _one_error(capsys)


def test_a_bom_and_unknown_characters_are_read_and_counted(tmp_path, tokenizer) -> None:
    from megatron_ppo.config import load_config
    from megatron_ppo.data.rows import read_rows
    from megatron_ppo.data.tokenizer import load_tokenizer

    data = tmp_path / "bom.jsonl"
    data.write_bytes(
        "\ufeff".encode() + (json.dumps(GOOD) + "\n" + json.dumps(GOOD | {"response": "3 three"})).encode()
    )
    config = load_config(RECIPE, ["data.task=null"])
    rows, report = read_rows([data], load_tokenizer(tokenizer), config.data)
    assert len(rows) == 2 and report.unknown_characters == 1
    assert "1 rows hold characters outside the tokenizer's vocabulary" in report.summary()
    assert f"{data}:2: " in report.first_unknown and "'ehrt'" in report.first_unknown, report.first_unknown


def test_the_rejects_file_is_strict_json(tmp_path, tokenizer) -> None:
    from megatron_ppo.config import load_config
    from megatron_ppo.data.rows import read_rows
    from megatron_ppo.data.tokenizer import load_tokenizer

    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(GOOD) + "\n" + '{"prompt": "1+2=", "response": "3", "reward": NaN}\n')
    config = load_config(RECIPE, ["data.task=null", "data.on_bad_row=skip"])
    read_rows([data], load_tokenizer(tokenizer), config.data, rejects_path=tmp_path / "rejects.jsonl")
    entry = json.loads((tmp_path / "rejects.jsonl").read_text(), parse_constant=pytest.fail)
    assert entry["row"]["reward"] == "NaN" and entry["kind"] == "non_finite"


@pytest.mark.parametrize(("args", "named"), [
    (["validate", str(RECIPE), "actor.ppo_micro_batch_size_per_gpu=0"],
     "actor.ppo_micro_batch_size_per_gpu=0: must be ≥ 1"),
    (["plan", str(RECIPE), "--nodes", "0"], "cluster.nodes=0: must be ≥ 1"),
    (["convert", "hf-to-mcore", "--out", "/tmp/never-written"], "needs --hf"),
    (["convert", "mcore-to-hf", "--out", "/tmp/never-written"], "needs --megatron and --hf-config"),
    (["convert", "hf-to-mcore", "--hf", "/nonexistent", "--out", "/tmp/never-written"],
     "/nonexistent holds no config.json"),
])  # fmt: skip
def test_config_and_conversion_inputs_end_in_one_line(capsys, args, named) -> None:
    assert main(args) == 2
    assert named in _one_error(capsys)
    assert not Path("/tmp/never-written").exists()


def test_a_conversion_never_writes_into_a_run_directory(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    for step in (2, 4):
        (run / f"step_{step}").mkdir(parents=True)
        (run / f"step_{step}" / "trainer_state.pt").write_bytes(b"weights")
    (run / "latest").write_text("step_4")
    before = sorted((p.relative_to(run), p.read_bytes() if p.is_file() else None) for p in run.rglob("*"))
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{not json")
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(run)]) == 2
    message = _one_error(capsys)
    assert f"--out {run} holds a training run's checkpoints (step_2, step_4; `latest` names step_4)" in message
    assert before == sorted((p.relative_to(run), p.read_bytes() if p.is_file() else None) for p in run.rglob("*"))
    assert main(["convert", "hf-to-mcore", "--hf", str(hf), "--out", str(tmp_path / "new")]) == 2
    assert "config.json" in _one_error(capsys) and not (tmp_path / "new").exists()


def test_report_on_garbage_event_files_says_so(tmp_path, capsys) -> None:
    (tmp_path / "events.out.tfevents.1.host").write_bytes(b"\x00garbage, not a TensorBoard record" * 8)
    assert main(["report", str(tmp_path)]) == 2
    assert "hold no TensorBoard records" in _one_error(capsys)


def test_a_taken_port_is_named_with_the_fix(tmp_path, tokenizer, capsys, monkeypatch) -> None:
    data = tmp_path / "rows.jsonl"
    data.write_text((json.dumps(GOOD) + "\n") * 4)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        assert main(_train_args(tmp_path, tokenizer, data)) == 2
    message = _one_error(capsys)
    assert f"port {port} on 127.0.0.1 (MASTER_PORT) is already in use" in message and "torchrun --standalone" in message
    assert port_taken(message), "the tests' launches must recognise this refusal and try another port"


def test_data_smaller_than_one_batch_is_the_users_error_naming_the_key(tmp_path, tokenizer, capsys) -> None:
    """One row for `data.train_batch_size=2`: one `error:` block naming the rows and the key to change, exit 2,
    before any run starts (it was a `ValueError` and "this is a bug")."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps(GOOD) + "\n")
    assert main(_train_args(tmp_path, tokenizer, data)) == 2
    message = _one_error(capsys)
    assert "the data gives 1 rows, fewer than one batch of data.train_batch_size=2" in message, message
    assert "set data.train_batch_size to at most 1" in message, message
    assert not (tmp_path / "tb").exists() or not any((tmp_path / "tb").iterdir()), "nothing logged: no run started"


FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "trainer_checkpoint"  # 1 layer, hidden 32, 2 heads
FIXTURE_MODEL = ("model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2")


def test_validate_refuses_a_model_that_does_not_match_its_checkpoint(tmp_path, capsys) -> None:
    """The tiny recipe's model (2 layers, hidden 128, 4 heads) with a checkpoint of 1 layer, hidden 32, 2 heads:
    `validate` names each differing setting with both values and exits 2 (it accepted it, and `train` died in
    Megatron's `Global shape mismatch`); with the checkpoint's shape it passes."""
    new_run = f"trainer.default_local_dir={tmp_path / 'ckpt'}"  # not the recipe's, which a `make train` fills
    assert main(["validate", str(RECIPE), f"model.init_checkpoint={FIXTURE}", new_run]) == 2
    message = _one_error(capsys)
    for named in ("model.hidden_size: the config builds 128", "model.num_layers: the config builds 2",
                  "(4 + 2·4)·32 = 384 QKV rows", "model.ffn_hidden_size: the config builds 512"):  # fmt: skip
        assert named in message, message
    assert "[1, 96, 32]" in message and str(FIXTURE / "step_1") in message, message
    assert main(["validate", str(RECIPE), f"model.init_checkpoint={FIXTURE}", new_run, *FIXTURE_MODEL]) == 0


def test_validate_refuses_a_resume_into_a_model_of_another_shape(tmp_path, capsys) -> None:
    """A run directory whose `latest` checkpoint holds another model than the config's (the model changed between
    jobs): `validate` names each differing setting, the checkpoint a resume continues and how to start a new run
    instead, exit 2; the checkpoint's own model, or a new run elsewhere, passes."""
    run = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, run)
    assert main(["validate", str(RECIPE), f"trainer.default_local_dir={run}"]) == 2
    message = _one_error(capsys)
    assert "model.hidden_size: the config builds 128" in message and str(run / "step_1") in message, message
    assert "trainer.resume_mode=auto continues" in message and "another trainer.default_local_dir" in message, message
    assert main(["validate", str(RECIPE), f"trainer.default_local_dir={run}", *FIXTURE_MODEL]) == 0
    assert main(["validate", str(RECIPE), f"trainer.default_local_dir={tmp_path / 'new'}"]) == 0
    named = ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={run / 'step_1'}"]
    assert main(["validate", str(RECIPE), f"trainer.default_local_dir={tmp_path / 'new'}", *named]) == 2
    assert "trainer.resume_mode=resume_path continues" in _one_error(capsys)


def test_the_tiny_task_refuses_a_resume_into_another_shape_before_its_sft(tmp_path, capsys) -> None:
    """`train` on the tiny recipe into a run directory of another model: refused before the task builds anything
    (it trained the new shape's SFT policy for ≈ 105 s, then died loading the checkpoint)."""
    run, work = tmp_path / "ckpt", tmp_path / "task"
    shutil.copytree(FIXTURE, run)
    args = ["train", str(RECIPE), "cluster.gpus_per_node=1", f"data.addition.work_dir={work}",
            *(f"{role}.megatron.tensor_model_parallel_size=1" for role in ("actor", "ref", "critic")),
            f"trainer.default_local_dir={run}", f"trainer.log_dir={tmp_path}/tb"]  # fmt: skip
    assert main(args) == 2
    message = _one_error(capsys)
    assert "model.hidden_size: the config builds 128" in message and "trainer.resume_mode=auto" in message, message
    assert not work.exists() or not any(work.iterdir()), "nothing of the task was built"


def test_training_refuses_a_model_that_does_not_match_its_checkpoint_before_building_it(
    tmp_path, tokenizer, capsys, monkeypatch
) -> None:
    """The same through `train` (the run's process group started, its models not yet built): one `error:` block
    naming the settings, exit 2, where Megatron's load used to stop with a traceback."""
    monkeypatch.delenv("MASTER_PORT", raising=False)  # its own process group on a port the OS picks
    data = tmp_path / "rows.jsonl"
    data.write_text((json.dumps(GOOD) + "\n") * 4)
    args = _train_args(tmp_path, tokenizer, data, f"model.init_checkpoint={FIXTURE}", "model.allow_random_init=false")
    assert main(args) == 2
    message = _one_error(capsys)
    assert "model.hidden_size: the config builds 128" in message and "model.num_layers" in message, message
    assert "Global shape mismatch" not in message
