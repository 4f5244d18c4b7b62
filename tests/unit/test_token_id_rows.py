"""Token-id rows are used exactly as given; text rows are checked by tokenizing prompt and response apart against
together (data.tokenization_check), and text rows with behaviour log-probs must tokenize the same either way."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data import DataError, Row, read_rows
from megatron_ppo.data.tokenizer import HFTokenizer, load_tokenizer
from tests.support.data_fixtures import tokenizer_dir

# "Hel" + "lo there" merges across the boundary when tokenized together; "Hello" + " there" does not.
MERGING = {"prompt": "Hel", "response": "lo there"}
CLEAN = {"prompt": "Hello", "response": " there"}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return load_tokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok") / "bpe", "chatml"))


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_example_rows_tokenize_as_the_tests_assume(tokenizer: HFTokenizer) -> None:
    def apart(r: dict) -> list[int]:
        return tokenizer.encode(r["prompt"]) + tokenizer.encode(r["response"])

    assert apart(MERGING) != tokenizer.encode(MERGING["prompt"] + MERGING["response"])
    assert apart(CLEAN) == tokenizer.encode(CLEAN["prompt"] + CLEAN["response"])


def test_token_id_rows_are_used_as_given_from_jsonl_and_parquet(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    last = tokenizer.vocab_size - 1
    records = [
        {"prompt_ids": [5, 6, 7], "response_ids": [8, last], "behavior_log_probs": [-0.5, -1.5], "reward": 1.0,
         "token_rewards": None, "prompt": None, "uid": "g"},
        {"prompt_ids": [0], "response_ids": [9, 10, tokenizer.eos_id], "behavior_log_probs": None, "reward": None,
         "token_rewards": [0.0, 0.5, 1.0], "prompt": "ignored text", "uid": None},
    ]  # fmt: skip
    jsonl = _write(tmp_path / "ids.jsonl", records)
    parquet = tmp_path / "ids.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet)
    for path in (jsonl, parquet):
        rows, report = read_rows([path], tokenizer, DataConfig(tokenization_check="strict"))
        source = f"{path}:2" if path.suffix == ".jsonl" else f"{path}:row 1"
        assert rows == [
            Row([5, 6, 7], [8, last], 1.0, None, [-0.5, -1.5], "g", "", rows[0].source),
            Row([0], [9, 10, tokenizer.eos_id], None, [0.0, 0.5, 1.0], None, rows[1].uid, "", source),
        ], f"{path.suffix}: no eos appended, no re-tokenization, per-token lists as given"
        assert rows[1].uid.startswith("prompt:"), "no uid: the group of its prompt ids"
        assert report.tokenization_mismatches == 0


BAD_ID_ROWS = [
    ({"prompt_ids": [1, 2], "response_ids": [3, 390]}, "token_out_of_vocab", "'response_ids'[1] = 390 is outside"),
    ({"prompt_ids": [-1], "response_ids": [3]}, "token_out_of_vocab", "'prompt_ids'[0] = -1 is outside"),
    ({"prompt_ids": [1, 2.0], "response_ids": [3]}, "wrong_type", "'prompt_ids'[1] is a number 2.0"),
    ({"prompt_ids": [1], "response_ids": [True]}, "wrong_type", "'response_ids'[0] is a boolean"),
    ({"prompt_ids": [1, 2]}, "missing_field", "'response_ids' is missing"),
    ({"response_ids": [1, 2]}, "missing_field", "'prompt_ids' is missing"),
    ({"prompt_ids": [], "response_ids": [3]}, "wrong_type", "expected a non-empty list of integer token ids"),
    ({"prompt_ids": "1 2", "response_ids": [3]}, "wrong_type", "'prompt_ids' is a string"),
    ({"prompt_ids": [1], "response_ids": [3, 4], "behavior_log_probs": [-1.0]}, "length_mismatch",
     "one per 'response_ids' entry"),
    ({"prompt_ids": [1], "response_ids": [3, 4], "token_rewards": [1, 2, 3], "reward": None}, "length_mismatch",
     "has 3 entries but the response has 2 tokens"),
    ({"prompt_ids": [1], "response_ids": [3], "response": 5}, "wrong_type", "'response' is a number"),
]  # fmt: skip


@pytest.mark.parametrize(("record", "kind", "phrase"), BAD_ID_ROWS, ids=[k for _, k, _ in BAD_ID_ROWS])
def test_bad_token_id_rows_name_file_line_and_problem(
    tokenizer: HFTokenizer, tmp_path: Path, record: dict, kind: str, phrase: str
) -> None:
    assert tokenizer.vocab_size == 390, "the BPE of data_fixtures.py: 390 tokens"
    good = {"prompt_ids": [1], "response_ids": [2], "reward": 0.0}
    path = _write(tmp_path / "ids.jsonl", [good, {"reward": 1.0, **record}])
    with pytest.raises(DataError) as error:
        read_rows([path], tokenizer, DataConfig())
    assert str(error.value).startswith(f"{path}:2: ") and phrase in str(error.value), str(error.value)
    _, report = read_rows([path], tokenizer, DataConfig(on_bad_row="skip"), rejects_path=tmp_path / "rejects.jsonl")
    assert report.reasons == {kind: 1}


def test_strict_rejects_a_text_row_that_tokenizes_differently_together(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    path = _write(tmp_path / "text.jsonl", [{**CLEAN, "reward": 1}, {**MERGING, "reward": 1}])
    expected = (
        r"text\.jsonl:2: prompt and response tokenize to \d+ ids apart but \d+ together, first differing at token "
        r"\d+ .*data\.tokenization_check=strict"
    )
    with pytest.raises(DataError, match=expected):
        read_rows([path], tokenizer, DataConfig(tokenization_check="strict"))


def test_warn_keeps_the_ids_apart_and_counts_the_row(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    path = _write(tmp_path / "text.jsonl", [{**CLEAN, "reward": 1}, {**MERGING, "reward": 1}, {**MERGING, "reward": 0}])
    rows, report = read_rows([path], tokenizer, DataConfig(tokenization_check="warn"))
    assert rows[1].prompt_ids == tokenizer.encode("Hel")
    assert rows[1].response_ids == [*tokenizer.encode("lo there"), tokenizer.eos_id]
    assert (report.rows_kept, report.tokenization_mismatches) == (3, 2)
    assert f"2 rows tokenize differently apart than together, kept with the ids apart (data.tokenization_check=warn; " \
           f"first: {path}:2: prompt and response tokenize" in report.summary()  # fmt: skip
    _, unchecked = read_rows([path], tokenizer, DataConfig(tokenization_check="off"))
    assert unchecked.tokenization_mismatches == 0 and "tokenize differently" not in unchecked.summary()


@pytest.mark.parametrize("mode", ["warn", "off"])
def test_text_rows_with_log_probs_must_tokenize_the_same_together(
    tokenizer: HFTokenizer, tmp_path: Path, mode: str
) -> None:
    n_clean = len(tokenizer.encode(CLEAN["response"]))
    n_merging = len(tokenizer.encode(MERGING["response"]))
    clean = {**CLEAN, "reward": 1, "behavior_log_probs": [-0.25] * n_clean}
    merging = {**MERGING, "reward": 1, "behavior_log_probs": [-0.25] * n_merging}
    rows, _ = read_rows([_write(tmp_path / "ok.jsonl", [clean])], tokenizer, DataConfig(tokenization_check=mode))
    assert rows[0].behavior_log_probs == [-0.25] * n_clean + [0.0]
    expected = (
        r"bad\.jsonl:1: .*'behavior_log_probs' belong to the sampled tokens, which re-tokenizing does not reproduce\)"
        r".*'prompt_ids'/'response_ids'"
    )
    with pytest.raises(DataError, match=expected):
        read_rows([_write(tmp_path / "bad.jsonl", [merging])], tokenizer, DataConfig(tokenization_check=mode))
    short = {**CLEAN, "reward": 1, "behavior_log_probs": [-0.25] * (n_clean + 1)}
    with pytest.raises(DataError, match=rf"short\.jsonl:1: 'behavior_log_probs' has {n_clean + 1} entries but the "
                                        rf"response has {n_clean} tokens"):  # fmt: skip
        read_rows([_write(tmp_path / "short.jsonl", [short])], tokenizer, DataConfig(tokenization_check=mode))
