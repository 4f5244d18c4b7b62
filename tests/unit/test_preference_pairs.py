"""Preference pairs as data: a (prompt, chosen, rejected) row is two rows of one group, rewarded by the given score
columns or, chosen explicitly, +1/−1; a training run refuses pairs a reward model must score; `score` reads pairs
and bad rows as training does (data.on_bad_row); a killed write leaves nothing under the scored file's name."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from megatron_ppo.config.schema import DataConfig, PPOConfig
from megatron_ppo.convert.reward_scoring import _readable_rows, write_parquet_atomically
from megatron_ppo.data import DataError, read_rows, render_builtin_chat
from megatron_ppo.data.rows import SCORED_BY_KEY, scored_by
from tests.unit.test_data_rows import TOK

PAIR = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "5", "chosen_score": 8.5,
        "rejected_score": 2.0, "source_set": "ultra"}  # fmt: skip


def _write(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_a_pair_is_two_rows_of_one_group_with_the_given_scores(tmp_path: Path) -> None:
    other = {**PAIR, "chosen": "four", "rejected": "five", "chosen_score": 1.0, "rejected_score": 3.0}
    path = _write(tmp_path / "pairs.jsonl", [PAIR, other, {"prompt": "1+1?", "response": "2", "reward": 0.5}])
    rows, report = read_rows([path], TOK, DataConfig(pair_reward="given"))
    assert [(r.reward, r.source.removeprefix(f"{path}:")) for r in rows] == [
        (8.5, "1 (chosen)"),
        (2.0, "1 (rejected)"),
        (1.0, "2 (chosen)"),
        (3.0, "2 (rejected)"),
        (0.5, "3"),
    ]
    assert rows[0].uid == rows[1].uid == f"pair:{path}:1" and rows[2].uid == rows[3].uid != rows[0].uid
    assert rows[0].response_ids == [*TOK.encode("4"), TOK.eos_id]  # the responses, each its own row
    assert rows[1].response_ids == [*TOK.encode("5"), TOK.eos_id] and rows[0].prompt_ids == rows[1].prompt_ids
    assert (report.rows_read, report.rows_kept) == (5, 5)


def test_preference_rewards_are_plus_and_minus_one_and_a_given_uid_is_the_group(tmp_path: Path) -> None:
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b", "uid": 7}])
    rows, _ = read_rows([path], TOK, DataConfig(pair_reward="preference"))
    assert [(r.reward, r.uid) for r in rows] == [(1.0, "7"), (-1.0, "7")]


def test_column_names_are_configurable(tmp_path: Path) -> None:
    path = _write(tmp_path / "pairs.jsonl", [{"question": "q", "good": "a", "bad": "b", "sg": 1, "sb": 0}])
    config = DataConfig(prompt_key="question", chosen_key="good", rejected_key="bad", chosen_score_key="sg",
                        rejected_score_key="sb", pair_reward="given")  # fmt: skip
    rows, _ = read_rows([path], TOK, config)
    assert [r.reward for r in rows] == [1.0, 0.0]


BAD_PAIRS = [  # (record, pair_reward, kind, a phrase of the reason)
    ({"prompt": "q", "chosen": "a", "rejected": "b"}, "model", "unscored_pair", "megatron-ppo score"),
    ({"prompt": "q", "chosen": "a"}, "preference", "missing_field", "'rejected' is null"),
    ({"prompt": "q", "chosen": "a", "rejected": ["b"]}, "preference", "wrong_type", "'rejected' is a list"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "chosen_score": 1}, "given", "wrong_type", "'rejected_score'"),
    ({"prompt": "q", "chosen": "a", "rejected": " ", "chosen_score": 1, "rejected_score": 0}, "given",
     "empty_response", r"the pair's \(rejected\) row: 'response' .* has no tokens"),
    ({"prompt": "q", "chosen": "a", "rejected": "b", "reward": 1}, "preference", "ambiguous_reward", "both"),
]  # fmt: skip


@pytest.mark.parametrize(("record", "pair_reward", "kind", "phrase"), BAD_PAIRS)
def test_a_bad_pair_follows_on_bad_row(tmp_path: Path, record, pair_reward, kind, phrase) -> None:
    path = _write(tmp_path / "pairs.jsonl", [{"prompt": "ab", "response": "cd", "reward": 1}, record])
    with pytest.raises(DataError, match=rf"pairs\.jsonl:2: .*{phrase}"):
        read_rows([path], TOK, DataConfig(pair_reward=pair_reward, chosen_score_key="chosen_score"))
    rejects = tmp_path / "rejects.jsonl"
    rows, report = read_rows([path], TOK, DataConfig(pair_reward=pair_reward, on_bad_row="skip"), rejects)
    assert report.reasons == {kind: 1} and report.rejected == 1 and report.rows_read == 2 and len(rows) == 1
    assert json.loads(rejects.read_text())["row"] == record  # the whole pair, as it was written


def _scoring_config(**data) -> PPOConfig:
    return PPOConfig(data=DataConfig(**data))


def test_score_reads_pairs_and_bad_rows_as_training_does(tmp_path: Path) -> None:
    good = {"prompt": "ab", "response": "cd", "keep": [1, 2]}
    records = [good, PAIR, '{"prompt": "ab", "response": ', {"prompt": "ab", "response": ""},
               {"prompt": "q", "chosen": "a"}, {"prompt": "ab", "response": "cd", "token_rewards": [0, 1]},
               {"prompt": "ab", "response": "cdefghij" * 5}]  # fmt: skip
    path = _write(tmp_path / "rows.jsonl", records)
    with pytest.raises(DataError, match=r"rows\.jsonl:3: the line is not valid JSON"):
        _readable_rows(_scoring_config(), TOK, path, max_tokens=40)
    rows, rejects = _readable_rows(_scoring_config(on_bad_row="skip"), TOK, path, max_tokens=40)
    assert [r["kind"] for r in rejects] == ["invalid_json", "empty_response", "missing_field", "token_rewards",
                                            "too_long"]  # fmt: skip
    assert [r.record.get("pair") for r in rows] == [None, "chosen", "rejected"] and rows[0].record["keep"] == [1, 2]
    assert [r.needs_model for r in rows] == [True, True, True]  # data.pair_reward=model: the model scores the pair
    assert rows[1].ids == [*TOK.encode(render_builtin_chat(PAIR["prompt"])), *TOK.encode("4"), TOK.eos_id]
    given, _ = _readable_rows(_scoring_config(on_bad_row="skip", pair_reward="given"), TOK, path, max_tokens=40)
    assert [(r.needs_model, r.record.get("reward")) for r in given] == [(True, None), (False, 8.5), (False, 2.0)]


def _killed_while_writing(output: str) -> None:
    """Write a scored file, killed (SIGKILL) half-way through writing its bytes."""

    def write_then_die(table, where, **_):
        Path(where).write_bytes(b"PAR1 half a file")
        os.kill(os.getpid(), signal.SIGKILL)

    pq.write_table = write_then_die
    write_parquet_atomically([{"prompt": "a", "reward": 2.0}], Path(output), {SCORED_BY_KEY: "{}"})


def test_a_killed_scoring_job_leaves_no_file_under_the_final_name(tmp_path: Path) -> None:
    output = tmp_path / "rows.scored.parquet"
    write_parquet_atomically([{"prompt": "a", "reward": 1.0}], output, {SCORED_BY_KEY: json.dumps({"rows": 1})})
    fresh = tmp_path / "fresh.scored.parquet"
    for target in (output, fresh):  # over an earlier scoring, and where nothing was
        process = mp.get_context("fork").Process(target=_killed_while_writing, args=(str(target),))
        process.start()
        process.join()
        assert process.exitcode == -signal.SIGKILL
    assert not fresh.exists(), "a killed write left a file under the final name"
    assert pq.read_table(output).to_pylist() == [{"prompt": "a", "reward": 1.0}], "the earlier scored file changed"
    assert scored_by(output) == {"rows": 1}
