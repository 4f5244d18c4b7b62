"""Reading the offline dataset: every bad-row kind, skip mode's rejects file, over-long rows, chat prompts, Parquet."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data import DataError, Row, read_rows, render_builtin_chat

EOS = 99


class CharTokenizer:
    """One token per non-space character (ord % 50), so whitespace-only text has no tokens."""

    eos_id = EOS
    unk_id = None
    vocab_size = 100
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 50 for c in text if not c.isspace()]


TOK = CharTokenizer()
GOOD = '{"prompt": "ab", "response": "cd", "reward": 1.0}'

# (JSONL line, rejection kind, a phrase the message must contain)
BAD_ROWS = [
    ('{"prompt": "ab", "response": ', "invalid_json", "not valid JSON"),
    ("[1, 2]", "not_object", "expected an object"),
    ('{"response": "cd", "reward": 1}', "missing_field", "'prompt' is missing"),
    ('{"prompt": "ab", "reward": 1}', "missing_field", "'response' is missing"),
    ('{"prompt": "ab", "response": "cd"}', "missing_reward", "neither 'reward' nor 'token_rewards'"),
    ('{"prompt": "ab", "response": "cd", "reward": 1, "token_rewards": [0, 1]}', "ambiguous_reward", "exactly one"),
    ('{"prompt": "ab", "response": "cd", "reward": "high"}', "wrong_type", "'reward' is a string"),
    ('{"prompt": "ab", "response": "cd", "reward": true}', "wrong_type", "'reward' is a boolean"),
    ('{"prompt": 7, "response": "cd", "reward": 1}', "wrong_type", "'prompt' is a number"),
    ('{"prompt": "ab", "response": ["cd"], "reward": 1}', "wrong_type", "'response' is a list"),
    ('{"prompt": [{"role": "user"}], "response": "cd", "reward": 1}', "wrong_type", "'prompt' message 0"),
    ('{"prompt": [], "response": "cd", "reward": 1}', "wrong_type", "non-empty list of chat messages"),
    ('{"prompt": "ab", "response": "cd", "reward": NaN}', "non_finite", "'reward' is nan"),
    ('{"prompt": "ab", "response": "cd", "reward": -Infinity}', "non_finite", "expected a finite number"),
    ('{"prompt": "ab", "response": "", "reward": 1}', "empty_response", "has no tokens"),
    ('{"prompt": "ab", "response": "   ", "reward": 1}', "empty_response", "has no tokens"),
    ('{"prompt": " ", "response": "cd", "reward": 1}', "empty_prompt", "'prompt' has no tokens"),
    ('{"prompt": "ab", "response": "cd", "token_rewards": [1.0]}', "length_mismatch", "has 1 entries"),
    ('{"prompt": "ab", "response": "cd", "token_rewards": "1,2"}', "wrong_type", "'token_rewards' is a string"),
    ('{"prompt": "ab", "response": "cd", "token_rewards": [0, NaN]}', "non_finite", "'token_rewards'[1]"),
    (
        '{"prompt": "ab", "response": "cd", "reward": 1, "behavior_log_probs": [-1, -1, 0]}',
        "length_mismatch",
        "response has 2 tokens",
    ),
    ('{"prompt": "ab", "response": "cd", "reward": 1, "behavior_log_probs": [-1, 0.5]}', "positive_log_prob", "> 0"),
    (
        '{"prompt": "ab", "response": "cd", "reward": 1, "behavior_log_probs": [-Infinity, 0]}',
        "non_finite",
        "'behavior_log_probs'[0]",
    ),
    ('{"prompt": "ab", "response": "cd", "reward": 1, "uid": 1.5}', "wrong_type", "'uid' is a number"),
    ('{"prompt": "ab", "response": "cd", "reward": 1, "data_source": 3}', "wrong_type", "'data_source' is a number"),
]


def _config(**overrides) -> DataConfig:
    return DataConfig(**{"max_prompt_length": 64, "max_response_length": 64, **overrides})


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


@pytest.mark.parametrize(("line", "kind", "phrase"), BAD_ROWS, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(BAD_ROWS)])
def test_each_bad_row_raises_naming_file_line_and_problem(tmp_path: Path, line: str, kind: str, phrase: str) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [GOOD, line, GOOD])
    with pytest.raises(DataError) as error:
        read_rows([path], TOK, _config())
    message = str(error.value)
    assert message.startswith(f"{path}:2: "), message
    assert phrase in message and "expected" in message, message


def test_error_mode_stops_at_the_first_bad_row(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [GOOD, "[1]", "not json"])
    with pytest.raises(DataError, match=r"data\.jsonl:2: the row is a list"):
        read_rows([path], TOK, _config())


def test_skip_mode_writes_each_rejected_row_and_counts_it_by_kind(tmp_path: Path) -> None:
    lines = [GOOD] + [bad for bad, _, _ in BAD_ROWS] + [GOOD]
    path = _write_jsonl(tmp_path / "data.jsonl", lines)
    rejects_path = tmp_path / "out" / "nested" / "rejects.jsonl"
    rows, report = read_rows([path], TOK, _config(on_bad_row="skip"), rejects_path=rejects_path)

    assert [row.source for row in rows] == [f"{path}:1", f"{path}:{len(lines)}"]
    assert (report.rows_read, report.rows_kept, report.rejected) == (len(lines), 2, len(BAD_ROWS))
    assert report.reasons == dict(Counter(kind for _, kind, _ in BAD_ROWS))
    assert report.rejects_path == str(rejects_path)
    rejects = [json.loads(line) for line in rejects_path.read_text().splitlines()]
    assert [r["source"] for r in rejects] == [f"{path}:{n}" for n in range(2, len(lines))]
    assert [r["kind"] for r in rejects] == [kind for _, kind, _ in BAD_ROWS]
    assert all(phrase in r["reason"] for r, (_, _, phrase) in zip(rejects, BAD_ROWS, strict=True))
    assert rejects[0]["row"] == BAD_ROWS[0][0], "an unparsable line is kept as its raw text"
    assert rejects[1]["row"] == [1, 2], "a parsed row is kept as the object"
    assert f"rejected {len(BAD_ROWS)}" in report.summary() and str(rejects_path) in report.summary()


def test_skip_mode_without_a_rejects_path_is_refused(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [GOOD])
    with pytest.raises(DataError, match="rejects file"):
        read_rows([path], TOK, _config(on_bad_row="skip"))


def test_good_rows_get_ids_eos_aligned_per_token_lists_and_defaults(tmp_path: Path) -> None:
    lines = [
        '{"prompt": "ab", "response": "c d", "reward": 2, "extra": {"ignored": true}}',
        "",
        json.dumps(
            {
                "prompt": "x",
                "response": "yz",
                "token_rewards": [0.5, -1],
                "behavior_log_probs": [-0.1, 0],
                "uid": 7,
                "data_source": "gsm8k",
            }
        ),
    ]
    path = _write_jsonl(tmp_path / "data.jsonl", lines)
    rows, report = read_rows([path], TOK, _config())

    assert rows == [
        Row(
            prompt_ids=[ord("a") % 50, ord("b") % 50],
            response_ids=[ord("c") % 50, ord("d") % 50, EOS],
            reward=2.0,
            token_rewards=None,
            behavior_log_probs=None,
            uid=rows[0].uid,  # no uid given: the prompt's group (see test_rows_without_a_uid_are_grouped...)
            data_source="",
            source=f"{path}:1",
        ),
        Row(
            prompt_ids=[ord("x") % 50],
            response_ids=[ord("y") % 50, ord("z") % 50, EOS],
            reward=None,
            token_rewards=[0.5, -1.0, 0.0],
            behavior_log_probs=[-0.1, 0.0, 0.0],
            uid="7",
            data_source="gsm8k",
            source=f"{path}:3",
        ),
    ]
    assert (report.rows_read, report.rows_kept, report.rejected) == (2, 2, 0), "a blank line is not a row"


def test_custom_keys_name_the_columns(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", ['{"question": "ab", "answer": "cd", "score": 0.5, "prompt": 1}'])
    rows, _ = read_rows([path], TOK, _config(prompt_key="question", response_key="answer", reward_key="score"))
    assert (len(rows[0].prompt_ids), rows[0].reward) == (2, 0.5)


def _overlong_file(tmp_path: Path) -> Path:
    return _write_jsonl(
        tmp_path / "data.jsonl",
        [
            '{"prompt": "abcd", "response": "abc", "reward": 1}',  # 4 prompt, 3+eos response: fits exactly
            '{"prompt": "abcde", "response": "x", "reward": 1}',  # prompt one token too long
            '{"prompt": "a", "response": "wxyz", "token_rewards": [1, 2, 3, 4], "behavior_log_probs": '
            "[-1, -2, -3, -4]}",  # response + eos one token too long
        ],
    )


def test_overlong_rows_are_filtered_and_counted(tmp_path: Path) -> None:
    config = _config(max_prompt_length=4, max_response_length=4, overlong_policy="filter")
    rows, report = read_rows([_overlong_file(tmp_path)], TOK, config)
    assert [row.source.rsplit(":", 1)[1] for row in rows] == ["1"]
    assert (report.rows_read, report.rows_kept, report.filtered_overlong) == (3, 1, 2)
    assert (report.truncated_prompt, report.truncated_response) == (0, 0)


def test_overlong_rows_are_truncated_prompt_on_the_left_response_on_the_right(tmp_path: Path) -> None:
    config = _config(max_prompt_length=4, max_response_length=4, overlong_policy="truncate")
    rows, report = read_rows([_overlong_file(tmp_path)], TOK, config)
    ids = TOK.encode
    assert (report.rows_kept, report.filtered_overlong, report.truncated_prompt, report.truncated_response) == (
        3,
        0,
        1,
        1,
    )
    assert rows[0].response_ids == [*ids("abc"), EOS], "a response that fits with its eos is untouched"
    assert rows[1].prompt_ids == ids("bcde")
    assert rows[1].response_ids == [*ids("x"), EOS]
    assert rows[2].response_ids == ids("wxyz"), "the eos is cut"
    assert rows[2].token_rewards == [1.0, 2.0, 3.0, 4.0]
    assert rows[2].behavior_log_probs == [-1.0, -2.0, -3.0, -4.0]


def test_overlong_rows_are_an_error_naming_the_row_and_the_limit(tmp_path: Path) -> None:
    config = _config(max_prompt_length=4, max_response_length=4, overlong_policy="error")
    with pytest.raises(DataError, match=r"data\.jsonl:2: prompt has 5 tokens > data\.max_prompt_length=4"):
        read_rows([_overlong_file(tmp_path)], TOK, config)


@pytest.mark.parametrize("side", ["left", "right", "middle"])
@pytest.mark.parametrize("limit", [1, 4, 5])
def test_prompt_truncation_keeps_the_tokens_verl_keeps(tmp_path: Path, side: str, limit: int) -> None:
    import torch
    from verl.utils.torch_functional import postprocess_data

    prompt = "abcdefghi"  # 9 tokens
    path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps({"prompt": prompt, "response": "x", "reward": 1})])
    config = _config(max_prompt_length=limit, overlong_policy="truncate", prompt_truncation=side)
    rows, report = read_rows([path], TOK, config)
    ids = torch.tensor([TOK.encode(prompt)])
    verl_ids, _ = postprocess_data(ids, torch.ones_like(ids), limit, pad_token_id=0, truncation=side)
    assert rows[0].prompt_ids == verl_ids[0].tolist(), f"{side} truncation to {limit} keeps other tokens than verl"
    assert report.truncated_prompt == 1


def test_chat_prompts_are_rendered_with_the_documented_template(tmp_path: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert render_builtin_chat(messages) == "<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps({"prompt": messages, "response": "ok", "reward": 1})])
    rows, _ = read_rows([path], TOK, _config(max_prompt_length=256))
    assert rows[0].prompt_ids == TOK.encode(render_builtin_chat(messages))


def _without_origin(rows: list[Row]) -> list[Row]:
    return [dataclasses.replace(row, source="") for row in rows]


def test_parquet_gives_the_same_rows_as_jsonl(tmp_path: Path) -> None:
    records = [
        {
            "prompt": [{"role": "user", "content": "1+1="}],
            "response": "2",
            "reward": 1.0,
            "token_rewards": None,
            "uid": "g0",
            "data_source": "math",
        },
        {
            "prompt": [{"role": "user", "content": "2+2="}],
            "response": "45",
            "reward": None,
            "token_rewards": [0.0, -1.0],
            "uid": None,
            "data_source": None,
        },
    ]
    parquet_path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(records), parquet_path)
    jsonl_path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps(r) for r in records])

    from_parquet, report = read_rows([parquet_path], TOK, _config())
    from_jsonl, _ = read_rows([jsonl_path], TOK, _config())
    assert [row.source for row in from_parquet] == [f"{parquet_path}:row 0", f"{parquet_path}:row 1"]
    assert from_parquet[0].uid == "g0" and from_parquet[1].uid.startswith("prompt:"), "no uid: the prompt's group"
    assert [row.uid for row in from_parquet] == [row.uid for row in from_jsonl]
    assert _without_origin(from_parquet) == _without_origin(from_jsonl)
    assert report.rows_kept == 2


def test_parquet_bad_row_names_its_row_number(tmp_path: Path) -> None:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "ab", "response": "cd"}] * 2), path)
    with pytest.raises(DataError, match=r"data\.parquet:row 0: neither 'reward'"):
        read_rows([path], TOK, _config())


def test_format_comes_from_the_extension_unless_set(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.txt", [GOOD])
    with pytest.raises(DataError, match=r"cannot tell the format of .*data\.txt"):
        read_rows([path], TOK, _config())
    rows, _ = read_rows([path], TOK, _config(format="jsonl"))
    assert len(rows) == 1
    with pytest.raises(DataError, match="cannot read it as Parquet"):
        read_rows([path], TOK, _config(format="parquet"))


def test_rows_of_several_files_come_in_order(tmp_path: Path) -> None:
    first = _write_jsonl(tmp_path / "a.jsonl", [GOOD])
    second = _write_jsonl(tmp_path / "b.json", [GOOD, GOOD])
    rows, report = read_rows([first, second], TOK, _config())
    assert [row.source for row in rows] == [f"{first}:1", f"{second}:1", f"{second}:2"]
    assert report.rows_read == 3


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    present = _write_jsonl(tmp_path / "a.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"missing\.jsonl does not exist"):
        read_rows([present, tmp_path / "missing.jsonl"], TOK, _config())


def test_an_empty_dataset_is_an_error(tmp_path: Path) -> None:
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(DataError, match=r"no rows left in .*empty\.jsonl"):
        read_rows([empty], TOK, _config())
    all_long = _write_jsonl(tmp_path / "long.jsonl", ['{"prompt": "abcdef", "response": "x", "reward": 1}'])
    with pytest.raises(DataError, match="filtered 1 over-long"):
        read_rows([all_long], TOK, _config(max_prompt_length=2))


def test_rows_without_a_uid_are_grouped_by_their_prompt(tmp_path: Path) -> None:
    """GRPO's groups: a row without `uid` joins the rows with the same prompt, never a group of its own."""
    records = [{"prompt": "1+1=", "response": r, "reward": 1} for r in ("2", "3")]
    records += [{"prompt": "2+2=", "response": "4", "reward": 1}, {"prompt": "1+1=", "response": "2", "uid": 7}]
    path = _write_jsonl(tmp_path / "data.jsonl", [json.dumps({"reward": 0, **r}) for r in records])
    rows, _ = read_rows([path], TOK, _config())
    assert rows[0].uid == rows[1].uid != rows[2].uid
    assert rows[3].uid == "7"
