"""`megatron-ppo score` against `transformers`: a random one-label Qwen2 reward model, converted on first use under
the scoring layout, scores every row as `AutoModelForSequenceClassification` does (the logit at the last token),
fp32, at TP 1 × DP 2 with token-budget micro-batches, TP 2 and PP 2; the scored file keeps the rows' order and
columns and names the reward model in its metadata."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_ppo.data.rows import scored_by
from megatron_ppo.data.tokenizer import load_tokenizer
from tests.distributed import reward_scoring_workers as workers
from tests.distributed.harness import run_distributed
from tests.support.hf_models import save_hf_scorer, save_word_tokenizer, scoring_recipe

WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu"]

LAYOUTS = {  # world size, overrides: every layout with several micro-batches of different widths
    "tp1-dp2-dynamic": (2, ["reward_model.use_dynamic_bsz=true", "reward_model.forward_max_token_len_per_gpu=24"]),
    "tp2": (2, ["reward_model.megatron.tensor_model_parallel_size=2", "reward_model.micro_batch_size_per_gpu=3"]),
    "pp2": (2, ["reward_model.megatron.pipeline_model_parallel_size=2", "reward_model.micro_batch_size_per_gpu=3"]),
}


def _rows(count: int) -> list[dict]:
    rng = random.Random(0)
    return [{"prompt": " ".join(rng.choices(WORDS, k=rng.randint(1, 6))),
             "response": " ".join(rng.choices(WORDS, k=rng.randint(1, 5))), "uid": f"u{i % 3}", "n": i}
            for i in range(count)]  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scores_equal_transformers_sequence_classifier(tmp_path: Path, layout: str) -> None:
    hf_dir = save_hf_scorer("qwen2", tmp_path / "rm")
    rows = _rows(11)
    save_word_tokenizer(tmp_path, WORDS)
    with (tmp_path / "rows.jsonl").open("w") as out:
        out.writelines(json.dumps(row) + "\n" for row in rows)
    world, overrides = LAYOUTS[layout]
    recipe = scoring_recipe(tmp_path, hf_dir, world, {"model": {"path": str(hf_dir)}},
                            {"train_files": [str(tmp_path / "rows.jsonl")]})  # fmt: skip
    ours = run_distributed(workers.score_recipe, world, str(recipe), overrides)[-1]
    tokenizer = load_tokenizer(tmp_path / "tokenizer.json")
    sequences = [tokenizer.encode(r["prompt"]) + tokenizer.encode(r["response"]) + [tokenizer.eos_id] for r in rows]
    assert all(0 not in ids for ids in sequences), "a token equal to the classifier's pad id would move its pooling"
    expected = workers.hf_rewards(str(hf_dir), sequences)
    assert max(abs(e) for e in expected) > 0.1, "the test model's scores are too small to show a misplaced head"
    difference = max(abs(a - b) for a, b in zip(ours, expected, strict=True))
    assert difference < 1e-4, f"{layout}: scores differ from transformers' by {difference:.2e}"

    written = pq.read_table(tmp_path / "rows.scored.parquet").to_pylist()
    assert [{k: v for k, v in r.items() if k != "reward"} for r in written] == rows  # order and columns kept
    assert [r["reward"] for r in written] == pytest.approx(ours, abs=1e-6)
    info = scored_by(tmp_path / "rows.scored.parquet")
    assert info["reward_model"] == str(hf_dir.resolve()) and len(info["checkpoint_hash"]) == 16
