"""R3 rows: `routed_experts` ([token][layer][k] expert indices, the last token's may be missing) read and checked
against the model; a row that does not match it is a data error naming its file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data import DataError, read_rows
from megatron_ppo.data.tokenizer import HFTokenizer, load_tokenizer
from megatron_ppo.data.values import RoutingShape
from megatron_ppo.train.batch import collate
from tests.support.data_fixtures import tokenizer_dir

SHAPE = RoutingShape(num_layers=2, topk=2, num_experts=4)
GOOD = [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[0, 3], [1, 2]], [[2, 1], [0, 3]]]  # 4 tokens, 2 layers, top-2


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return load_tokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok") / "bpe", "chatml"))


def _rows(tmp_path: Path, tokenizer: HFTokenizer, second: dict, routing: RoutingShape | None = SHAPE):
    rows = [{"prompt_ids": [5, 6], "response_ids": [7, 8], "reward": 1.0, "routed_experts": GOOD},
            {"prompt_ids": [5, 6], "response_ids": [7, 8], "reward": 0.0, **second}]  # fmt: skip
    path = tmp_path / "r3.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, read_rows([path], tokenizer, DataConfig(), routing=routing)


def test_routes_are_read_and_collated_as_expert_plus_one(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    _, (rows, _) = _rows(tmp_path, tokenizer, {"routed_experts": GOOD[:3]})  # the last token's route missing
    assert torch.equal(rows[0].routed_experts, torch.tensor(GOOD, dtype=torch.int32))
    batch = collate(rows, pad_id=0)
    assert batch["routed_experts"].shape == (2, 4, 2, 2)
    assert torch.equal(batch["routed_experts"][0].long() - 1, torch.tensor(GOOD))
    assert batch["routed_experts"][1, 3].eq(0).all()  # no record: replay gives it experts 0..k-1


def test_without_r3_the_column_is_not_read(tmp_path: Path, tokenizer: HFTokenizer) -> None:
    _, (rows, _) = _rows(tmp_path, tokenizer, {"routed_experts": "anything"}, routing=None)
    assert all(row.routed_experts is None for row in rows)
    assert "routed_experts" not in collate(rows, pad_id=0)


@pytest.mark.parametrize(
    ("second", "says"),
    [
        ({}, "'routed_experts' is missing"),
        ({"routed_experts": [[[0, 1]]] * 4}, "model.num_layers"),  # one layer, the model has two
        ({"routed_experts": [[[0], [1]]] * 4}, "top-2"),  # top-1
        ({"routed_experts": GOOD[:2]}, "4 (or 3) tokens"),
        ({"routed_experts": [[[0, 4], [1, 2]]] * 4}, "model.num_experts=4"),
        ({"routed_experts": [[[1, 1], [1, 2]]] * 4}, "same expert twice"),
        ({"routed_experts": [[[0, 1], [2]]] * 4}, "rectangular"),
    ],
)
def test_a_row_that_does_not_match_the_model_names_file_and_line(
    tmp_path: Path, tokenizer: HFTokenizer, second: dict, says: str
) -> None:
    with pytest.raises(DataError) as error:
        _rows(tmp_path, tokenizer, second)
    assert f"{tmp_path / 'r3.jsonl'}:2:" in str(error.value)
    assert says in str(error.value)
