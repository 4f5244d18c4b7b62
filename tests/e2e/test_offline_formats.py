"""Token-id rows and verl-format rows train through the real CLI (`torchrun -m megatron_ppo train <recipe>`): a
random tiny Llama from `transformers` (converted on first use), a BPE tokenizer with a ChatML chat template, and
one batch that holds every row, so the logged reward and response length are those of the rows as read."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import transformers
import yaml

from megatron_ppo.data.tokenizer import load_tokenizer
from megatron_ppo.models.hf_conversion import model_config_from_hf
from megatron_ppo.runs.report import read_run
from tests.support.data_fixtures import GSM8K, INSTRUCTION, tokenizer_dir, verl_row
from tests.support.tensorboard import scalars

REPO = Path(__file__).resolve().parents[2]
ROWS = 16  # 8 token-id rows + 8 verl-format rows, all in the one batch


def _tiny_llama(directory: Path) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory


def _token_id_rows(path: Path, tokenizer) -> list[dict]:
    """Rows as a sampler writes them: the prompt ids it was given, the ids it sampled (ending in eos, or cut at a
    length limit without one), their log-probs and a reward."""
    rows = []
    for i in range(ROWS // 2):
        question, _, response = GSM8K[i % len(GSM8K)]
        prompt = tokenizer.chat_template.render([{"role": "user", "content": question + INSTRUCTION}])
        sampled = tokenizer.encode(response)[: 12 + i] + ([tokenizer.eos_id] if i % 2 else [])
        rows.append({"prompt_ids": tokenizer.encode(prompt), "response_ids": sampled,
                     "behavior_log_probs": [-0.5] * len(sampled), "reward": float(i % 3 == 0)})  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def _verl_rows(path: Path) -> tuple[list[dict], list[float]]:
    """verl's GSM8K layout with our response and no reward (the trainer scores it at load time), and the rewards
    verl's own scorer gives those rows."""
    from verl.utils.reward_score import default_compute_score

    rows = [verl_row(i, *GSM8K[i % len(GSM8K)]) for i in range(ROWS // 2)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    expected = [default_compute_score(r["data_source"], r["response"], r["reward_model"]["ground_truth"]) for r in rows]
    return rows, expected


def _megatron_ppo(*words) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_ppo", *map(str, words)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, check=False, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def test_token_id_and_verl_rows_train_through_the_cli(tmp_path: Path) -> None:
    tokenizer_path = tokenizer_dir(tmp_path / "tokenizer", "chatml")
    tokenizer = load_tokenizer(tokenizer_path)
    hf_dir = _tiny_llama(tmp_path / "llama")
    id_rows = _token_id_rows(tmp_path / "ids.jsonl", tokenizer)
    verl_rows, verl_rewards = _verl_rows(tmp_path / "gsm8k.parquet")
    assert set(verl_rewards) == {0.0, 1.0}, "the test rows should hold right and wrong answers"
    recipe = {
        "defaults": ["defaults", "clusters/cpu"],
        "model": {**model_config_from_hf(hf_dir), "hf_checkpoint": str(hf_dir), "params_dtype": "fp32",
                  "tokenizer": str(tokenizer_path)},
        "data": {"train_files": [str(tmp_path / "ids.jsonl"), str(tmp_path / "gsm8k.parquet")],
                 "train_batch_size": ROWS, "max_prompt_length": 256, "max_response_length": 64,
                 "tokenization_check": "strict", "val_files": [str(tmp_path / "gsm8k.parquet")]},
        "actor": {"ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 8, "optim": {"lr": 1.0e-3}},
        "critic": {"ppo_mini_batch_size": ROWS, "ppo_micro_batch_size_per_gpu": 8},
        "reward": {"score_fn": "verl"},
        "trainer": {"total_epochs": 2, "total_training_steps": 2, "test_freq": 2,
                    "default_local_dir": str(tmp_path / "ckpt"), "log_dir": str(tmp_path / "tb"),
                    "logger": ["console", "tensorboard"]},
        "cluster": {"gpus_per_node": 1},
    }  # fmt: skip
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    # prepared first, as on a CPU node before the job: the job then finds both datasets prepared
    prepared = _megatron_ppo("prepare", tmp_path / "recipe.yaml")
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    assert f"train: data: {ROWS} rows prepared here in " in prepared.stdout, prepared.stdout
    assert f"validation: data: {ROWS // 2} rows prepared here in " in prepared.stdout, prepared.stdout
    assert f"train: data: read {ROWS} rows, kept {ROWS}, rejected 0" in prepared.stdout, prepared.stdout
    torchrun = Path(sys.executable).with_name("torchrun")
    log = tmp_path / "train.log"
    with log.open("w") as out:
        result = subprocess.run(
            [str(torchrun), "--nproc_per_node=1", "--standalone", "-m", "megatron_ppo", "train",
             str(tmp_path / "recipe.yaml")],
            cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}, stdout=out,
            stderr=subprocess.STDOUT, timeout=600, check=False,
        )  # fmt: skip
    text = log.read_text()
    assert result.returncode == 0, f"training exited {result.returncode}; log tail:\n{text[-4000:]}"
    data = [e.message for e in read_run(tmp_path / "tb")[1] if e.tag == "data"]  # the whole lines
    assert data[0].startswith(f"data: {ROWS} rows prepared earlier in {tmp_path / 'ckpt' / 'prepared'}"), data
    assert f"data: read {ROWS} rows, kept {ROWS}, rejected 0" in data[0], data
    assert data[1].startswith(f"validation: data: {ROWS // 2} rows prepared earlier"), data
    assert "data: preparing" not in text, "train and validation as `prepare` left them"

    logged = scalars(tmp_path / "tb")
    rewards = [row["reward"] for row in id_rows] + verl_rewards
    # token-id rows as given (eos only where sampled); text responses tokenized, then eos
    lengths = [len(row["response_ids"]) for row in id_rows] + [
        len(tokenizer.encode(r["response"])) + 1 for r in verl_rows
    ]
    for step in (1, 2):
        assert logged["reward/mean"][step] == pytest.approx(sum(rewards) / ROWS, abs=1e-6)
        assert logged["response_length/mean"][step] == pytest.approx(sum(lengths) / ROWS, abs=1e-6)
        assert math.isfinite(logged["actor/pg_loss"][step]) and math.isfinite(logged["critic/vf_loss"][step])
    # evaluation on data.val_files (the verl rows: greedy answers scored by verl) before training and at step 2
    evaluation = [e.message for e in read_run(tmp_path / "tb")[1] if e.tag == "evaluation"]
    assert evaluation[0] == (
        "8 validation rows; 8 with a ground truth are answered greedily and scored by "
        "verl.utils.reward_score.default_compute_score → eval/reward_mean; every 2 steps"
    ), evaluation
    # then one line per evaluation (step 0 and step 2): the prompts decoded, the tokens generated and their speed
    assert len(evaluation) == 3 and all(line.startswith("8 prompts, ") for line in evaluation[1:]), evaluation
    assert set(logged["eval/reward_mean"]) == {0, 2} and all(0 <= r <= 1 for r in logged["eval/reward_mean"].values())
    assert logged["eval/kl_mean"][0] == 0.0, "before any update the actor is the reference"
    assert logged["eval/kl_mean"][2] > 0.0 and logged["eval/log_prob_mean"][2] < 0.0, "two steps at lr 1e-3 move it"

    # a bad row: `prepare` stops naming its file and line, exit 2, and leaves nothing prepared
    bad = tmp_path / "bad.jsonl"
    bad.write_text((tmp_path / "ids.jsonl").read_text().splitlines()[0] + "\n" + '{"prompt_ids": [1], "response_ids"\n')
    refused = _megatron_ppo("prepare", tmp_path / "recipe.yaml", f"data.train_files={bad}", "data.val_files=[]")
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"error: {bad}:2: the line is not valid JSON" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert sorted(p.name for p in (tmp_path / "ckpt" / "prepared").iterdir() if "." not in p.name) == sorted(
        line.split(" in ")[-1].rsplit("/", 1)[-1] for line in prepared.stdout.splitlines() if "prepared here" in line
    ), "only the two good datasets"
