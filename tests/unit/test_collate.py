"""`train.batch.collate` against its definition, row by row: row r's P prompt and R response ids then padding,
labels shifted left by one, the loss mask and per-token values (token rewards, behaviour log-probs) at the label
positions P − 1 … P + R − 2, NaN sequence scores where a row gives token rewards, routed experts + 1 per token."""

from __future__ import annotations

import math
import random

import torch

from megatron_ppo.data.parse import Row
from megatron_ppo.train.batch import collate

PAD = 3


def _rows(count: int, seed: int, routed: bool) -> list[Row]:
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        prompt = [rng.randrange(100) for _ in range(rng.randint(1, 9))]
        response = [rng.randrange(100) for _ in range(rng.randint(1, 6))]
        token_rewards = [rng.uniform(-1, 1) for _ in response] if index % 3 == 0 else None
        behavior = [-rng.uniform(0.1, 5) for _ in response] if index % 2 else None
        experts = None
        if routed:  # one route per input token, the last one's sometimes missing
            tokens = len(prompt) + len(response) - rng.randint(0, 1)
            experts = torch.randint(
                0, 8, (tokens, 2, 2), dtype=torch.int32, generator=torch.Generator().manual_seed(index)
            )
        rows.append(Row(prompt, response, None if token_rewards else rng.choice([0.0, 1.0]), token_rewards, behavior,
                        f"uid-{index % 4}", "test", f"rows.jsonl:{index + 1}", experts))  # fmt: skip
    return rows


def _expected(row: Row, width: int) -> dict[str, torch.Tensor]:
    prompt, response = len(row.prompt_ids), len(row.response_ids)
    ids = row.prompt_ids + row.response_ids + [PAD] * (width - prompt - response)
    labels = slice(prompt - 1, prompt + response - 1)
    loss_mask, token_scores, behavior = torch.zeros(width), torch.zeros(width), torch.zeros(width)
    loss_mask[labels] = 1.0
    if row.token_rewards is not None:
        token_scores[labels] = torch.tensor(row.token_rewards)
    if row.behavior_log_probs is not None:
        behavior[labels] = torch.tensor(row.behavior_log_probs)
    return {"input_ids": torch.tensor(ids), "labels": torch.tensor(ids[1:] + ids[:1]), "loss_mask": loss_mask,
            "token_level_scores": token_scores, "behavior_log_prob": behavior}  # fmt: skip


def test_every_row_is_laid_out_as_defined() -> None:
    rows = _rows(40, seed=0, routed=False)
    batch = collate(rows, PAD)
    width = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    assert batch["input_ids"].shape == (40, width)
    for index, row in enumerate(rows):
        for key, value in _expected(row, width).items():
            assert torch.equal(batch[key][index], value), (key, index, batch[key][index], value)
        assert batch["lengths"][index] == len(row.prompt_ids) + len(row.response_ids)
        score = batch["scores"][index].item()
        assert math.isnan(score) if row.token_rewards is not None else score == row.reward
        assert batch["behavior_rows"][index] == (row.behavior_log_probs is not None)
    assert torch.equal(batch["position_ids"], torch.arange(width).expand(40, width))
    assert batch["group"].tolist() == [index % 4 for index in range(40)]


def test_rows_without_behaviour_log_probs_or_routes_add_no_such_column() -> None:
    rows = [row for row in _rows(12, seed=1, routed=False) if row.behavior_log_probs is None]
    batch = collate(rows, PAD)
    assert "behavior_log_prob" not in batch and "behavior_rows" not in batch and "routed_experts" not in batch


def test_routed_experts_are_recorded_plus_one_per_token_and_zero_past_them() -> None:
    rows = _rows(10, seed=2, routed=True)
    experts = collate(rows, PAD)["routed_experts"]
    assert experts.dtype == torch.uint8
    for index, row in enumerate(rows):
        recorded = len(row.routed_experts)
        assert torch.equal(experts[index, :recorded].long(), row.routed_experts.long() + 1)
        assert experts[index, recorded:].eq(0).all()
