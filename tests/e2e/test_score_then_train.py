"""Preference pairs scored by a reward model through the real CLI (`torchrun -m megatron_ppo score`), then trained on
(`... train` on the scored file): the scored file's rewards are the batch's, and the run's log names the reward model
that scored its data when the recipe's `reward_model.*` names another."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_ppo.runs.report import read_run
from tests.support.hf_models import offline_recipe, save_hf_model, save_hf_scorer
from tests.support.tensorboard import scalars

REPO = Path(__file__).resolve().parents[2]
PAIRS = [("hello", "world", "there"), ("good", "day", "night"), ("see", "you", "there"), ("good", "night", "day")]


def _cli(command: str, recipe: Path, overrides: list[str], log: Path) -> str:
    torchrun = Path(sys.executable).with_name("torchrun")
    with log.open("w") as out:
        result = subprocess.run(
            [str(torchrun), "--nproc_per_node=1", "--standalone", "-m", "megatron_ppo", command, str(recipe),
             *overrides],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out, stderr=subprocess.STDOUT, timeout=600,
            check=False,
        )  # fmt: skip
    text = log.read_text()
    assert result.returncode == 0, f"{command} exited {result.returncode}; log tail:\n{text[-4000:]}"
    return text


def test_scored_pairs_train_through_the_cli_and_the_log_names_their_reward_model(tmp_path: Path) -> None:
    actor_hf = save_hf_model("llama", tmp_path / "actor-hf", tied=False)
    reward_model = save_hf_scorer("qwen2", tmp_path / "reward-model")
    recipe = offline_recipe(tmp_path, actor_hf, tp=1)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": p, "chosen": c, "rejected": r}) + "\n" for p, c, r in PAIRS))
    log = _cli("score", recipe, [f"data.train_files={pairs}", f"reward_model.model.path={reward_model}"],
               tmp_path / "score.log")  # fmt: skip
    scored = tmp_path / "pairs.scored.parquet"
    assert f"scored 8 rows of {pairs} → {scored}" in log and "tokens/s" in log
    rows = pq.read_table(scored).to_pylist()
    assert [(r["prompt"], r["response"], r["pair"]) for r in rows] == [
        (p, response, side) for p, c, r in PAIRS for response, side in ((c, "chosen"), (r, "rejected"))
    ]
    assert len({r["uid"] for r in rows}) == 4 and rows[0]["uid"] == rows[1]["uid"]

    _cli("train", recipe, [f"data.train_files={scored}", f"reward_model.model.path={actor_hf}",
                           "trainer.total_training_steps=1"], tmp_path / "train.log")  # fmt: skip
    _, events = read_run(tmp_path / "tb")
    data = [e.message for e in events if e.tag == "data"]
    assert f"{scored} scored by the reward model {reward_model.resolve()}" in data[0]
    assert any(f"not by {actor_hf}, which reward_model.model.* names" in line for line in data[1:]), data
    (mean,) = scalars(tmp_path / "tb")["reward/mean"].values()
    assert mean == pytest.approx(sum(r["reward"] for r in rows) / len(rows), abs=1e-5)  # the batch: all 8 rows
