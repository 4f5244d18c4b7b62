"""The prepared dataset gives exactly the rows `read_rows` gives, in every format; it is keyed by what makes the rows
(a changed byte or data key prepares anew, a changed batch size does not); one process prepares while another waits;
a preparer killed midway leaves nothing a later run trusts."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_ppo.config.schema import CustomRewardFnConfig, DataConfig, RewardConfig
from megatron_ppo.data import DataError, build_scorer, read_rows
from megatron_ppo.data.columnar import TEXT, TOKEN_IDS, batch_columns, eligible
from megatron_ppo.data.prepare import REJECTS_FILE, prepared_rows
from megatron_ppo.data.prepared import column, rows_at
from megatron_ppo.data.tokenizer import HFTokenizer, load_tokenizer
from megatron_ppo.data.values import RoutingShape
from megatron_ppo.train.batch import collate
from tests.support.data_fixtures import tokenizer_dir, verl_row


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return load_tokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok") / "bpe", "chatml"))


def _jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def _parquet(path: Path, records: list[dict]) -> Path:
    keys = list(dict.fromkeys(key for record in records for key in record))  # from_pylist reads the first's keys
    pq.write_table(pa.Table.from_pylist([{key: record.get(key) for key in keys} for record in records]), path)
    return path


def _f32(values: list[float] | None) -> list[float] | None:
    return None if values is None else np.asarray(values, dtype=np.float32).tolist()


def _assert_same_rows(prepared, expected) -> None:
    """Field by field; per-token floats at float32 (the precision collate gives them: the batches are equal)."""
    assert len(prepared) == len(expected)
    got = list(prepared)
    for mine, theirs in zip(got, expected, strict=True):
        for field in dataclasses.fields(theirs):
            a, b = getattr(mine, field.name), getattr(theirs, field.name)
            if field.name in ("token_rewards", "behavior_log_probs"):
                b = _f32(b)
            if isinstance(b, torch.Tensor):
                assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), field.name
            else:
                assert a == b, (field.name, theirs.source)
    mine, theirs = collate(got, pad_id=0), collate(expected, pad_id=0)
    assert mine.keys() == theirs.keys()
    for key in theirs:
        assert torch.equal(mine[key].nan_to_num(-7.0), theirs[key].nan_to_num(-7.0)), key


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
TEXT_ROWS = [
    {"prompt": "Hello", "response": " there", "reward": 1.0, "uid": "a", "data_source": "greet"},
    {"prompt": "Hel", "response": "lo there", "reward": -0.5},  # tokenizes differently together (warn: kept)
    {"prompt": MESSAGES, "response": "4", "token_rewards": [0.25]},
    {"prompt": "Hello", "response": " there", "reward": 0.1, "behavior_log_probs": [-0.3]},
    {"prompt": "x" * 40, "response": "y" * 40, "reward": 2.0},  # over-long
    '{"prompt": "Hello", "response": ',  # not JSON
    {"prompt": "Hello", "response": " there", "reward": 2, "uid": 7},
]


def _cases(tmp_path: Path, tokenizer: HFTokenizer) -> dict[str, tuple[list[Path], DataConfig, dict]]:
    last = tokenizer.vocab_size - 1
    ids = [
        {"prompt_ids": [5, 6, 7], "response_ids": [8, last], "behavior_log_probs": [-0.5, -1.5], "reward": 1.0,
         "uid": "g"},
        {"prompt_ids": [0], "response_ids": [9, 10, tokenizer.eos_id], "token_rewards": [0.0, 0.5, 1.0]},
        {"prompt_ids": [1, 2], "response_ids": [3], "behavior_log_probs": [-0.1], "reward": 0.0, "uid": 3},
    ]  # fmt: skip
    pairs = [
        {"prompt": MESSAGES, "chosen": "4", "rejected": "5", "chosen_score": 8.5, "rejected_score": 2.0},
        {"prompt": "q", "chosen": "a", "rejected": "b", "chosen_score": 1.0, "rejected_score": 0.0, "uid": 9},
    ]
    scorer_file = tmp_path / "my_reward.py"
    scorer_file.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(ground_truth.strip() in solution_str) + (extra_info.get('bonus') or 0)\n"
    )
    verl = [verl_row(0, "What is 2+3?", "5", "#### 5"), {**verl_row(1, "What is 1+1?", "2", "#### 3"),
            "extra_info": {"bonus": 0.5, "split": "train"}}]  # fmt: skip
    routes = [[[0, 1], [2, 3]], [[1, 2], [3, 0]], [[0, 3], [1, 2]], [[2, 1], [0, 3]]]
    r3 = [
        {"prompt_ids": [5, 6], "response_ids": [7, 8], "reward": 1.0, "routed_experts": routes},
        {"prompt_ids": [5, 6], "response_ids": [7, 8], "reward": 0.0, "routed_experts": routes[:3]},
    ]
    text = [r for r in TEXT_ROWS if not isinstance(r, str)]
    small = {"max_prompt_length": 24, "max_response_length": 24}
    custom = {"scorer": build_scorer(RewardConfig(score_fn="custom", custom_fn=CustomRewardFnConfig(str(scorer_file))))}
    text_parquet = [{**r, "prompt": json.dumps(r["prompt"])} for r in text[:-1]]  # one type a column
    ids_parquet = [{**r, "uid": str(r.get("uid"))} for r in ids]
    return {
        "jsonl text, chat, skip": ([_jsonl(tmp_path / "text.jsonl", TEXT_ROWS)], DataConfig(**small, on_bad_row="skip"),
                                   {}),
        "jsonl truncate middle": ([_jsonl(tmp_path / "t2.jsonl", text)],
                                  DataConfig(**small, overlong_policy="truncate", prompt_truncation="middle"), {}),
        "parquet text": ([_parquet(tmp_path / "text.parquet", text_parquet)], DataConfig(**small), {}),
        "token ids jsonl + parquet": ([_jsonl(tmp_path / "ids.jsonl", ids), _parquet(tmp_path / "ids.parquet",
                                                                                      ids_parquet)],
                                      DataConfig(tokenization_check="strict"), {}),
        "token ids column-wise, a bad batch": ([_parquet(tmp_path / "many.parquet", _many_id_rows(tokenizer))],
                                               DataConfig(max_prompt_length=6, on_bad_row="skip"), {}),
        "text column-wise, warn, truncate middle, a bad batch": (
            [_parquet(tmp_path / "many-text.parquet", _many_text_rows())],
            DataConfig(max_prompt_length=12, max_response_length=10, overlong_policy="truncate",
                       prompt_truncation="middle", on_bad_row="skip"), {}),
        "text column-wise, off, filter": ([_parquet(tmp_path / "many-text-off.parquet", _many_text_rows()[:2048])],
                                          DataConfig(max_prompt_length=12, tokenization_check="off"), {}),
        "preference pairs": ([_jsonl(tmp_path / "pairs.jsonl", pairs)], DataConfig(pair_reward="given"), {}),
        "verl layout, scored": ([_parquet(tmp_path / "verl.parquet", verl)], DataConfig(max_prompt_length=512), custom),
        "R3 routes": ([_jsonl(tmp_path / "r3.jsonl", r3)], DataConfig(),
                      {"routing": RoutingShape(num_layers=2, topk=2, num_experts=4)}),
    }  # fmt: skip


def _many_id_rows(tokenizer: HFTokenizer) -> list[dict]:
    """2500 token-id rows (three Parquet batches): every optional column, over-long prompts (filtered), a given uid
    or none; the last batch holds a bad row (rejected: that batch is parsed row by row)."""
    generator = np.random.default_rng(0)
    rows = []
    for i in range(2500):
        prompt = generator.integers(0, tokenizer.vocab_size, int(generator.integers(1, 9))).tolist()
        response = generator.integers(0, tokenizer.vocab_size, int(generator.integers(1, 5))).tolist()
        values = (-generator.random(len(response))).tolist()
        token_rewards = i % 3 == 0
        rows.append({"prompt_ids": prompt, "response_ids": response,
                     "reward": None if token_rewards else float(generator.normal()),
                     "token_rewards": values if token_rewards else None,
                     "behavior_log_probs": values if i % 2 else None,
                     "uid": None if i % 5 else f"group-{i // 10}", "data_source": None if i % 7 else "ids",
                     "reward_model": {"ground_truth": str(i), "style": "rule"} if i % 4 == 0 else None,
                     "extra_info": {"index": i} if i % 6 == 0 else None})  # fmt: skip
    rows[2400]["behavior_log_probs"] = [0.5] * len(rows[2400]["response_ids"])
    return rows


def _many_text_rows() -> list[dict]:
    """2500 text rows (three Parquet batches): prompts repeated by groups of four (GRPO), joins that tokenize
    differently together ("Hel" + "lo"), over-long prompts and responses, a given uid or none, verl's columns; the
    last batch holds a row with an empty response (rejected: that batch is parsed row by row)."""
    generator = np.random.default_rng(1)
    words = ["Hello", "there", "world", "the", "answer", "is", "4", "2+2", "step", "by", "42", "Hel", "lo", "\n", "."]
    rows = []
    for i in range(2500):
        prompt = " ".join(generator.choice(words, int(generator.integers(1, 12))).tolist())
        if i % 4:
            prompt = rows[-1]["prompt"]
        response = (" " if i % 9 else "") + " ".join(generator.choice(words, int(generator.integers(1, 14))).tolist())
        rows.append({"prompt": prompt, "response": response, "reward": float(generator.normal()),
                     "uid": None if i % 5 else f"group-{i // 10}", "data_source": None if i % 7 else "text",
                     "reward_model": {"ground_truth": str(i), "style": "rule"} if i % 4 == 0 else None,
                     "extra_info": {"index": i} if i % 6 == 0 else None})  # fmt: skip
    rows[2400]["response"] = ""
    return rows


@pytest.mark.floor  # Megatron-Core's indexed dataset at the oldest version admitted
def test_prepared_rows_are_read_rows_in_every_format(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    for name, (paths, config, extra) in _cases(tmp_path, tokenizer).items():
        rejects = tmp_path / f"{name}.rejects.jsonl"
        expected, report = read_rows(paths, tokenizer, config, rejects_path=rejects, **extra)
        data = prepared_rows(paths, tokenizer, config, tmp_path / "prepared", say=lambda _: None, **extra)
        assert data.how.startswith("prepared here"), name
        _assert_same_rows(data.rows, expected)
        mine = dataclasses.asdict(data.report)
        assert mine.pop("rejects_path") == (None if report.rejects_path is None else str(data.directory / REJECTS_FILE))
        theirs = dataclasses.asdict(report)
        theirs.pop("rejects_path")
        assert mine == theirs, name
        if report.rejects_path is not None:
            assert (data.directory / REJECTS_FILE).read_text() == rejects.read_text()
        assert column(data.rows, "uid") == [r.uid for r in expected]
        assert column(data.rows, "has_behavior_log_probs") == [r.behavior_log_probs is not None for r in expected]
        order = list(range(len(expected)))[::-1]
        assert [r.source for r in rows_at(data.rows, order)] == [expected[i].source for i in order]
    assert report.rows_kept == 2 and data.rows[1].routed_experts.shape == (3, 2, 2)


def test_the_column_wise_reader_takes_clean_batches_and_leaves_a_bad_one_to_the_row_parser(
    tokenizer: HFTokenizer, tmp_path: Path
) -> None:
    path = _parquet(tmp_path / "many.parquet", _many_id_rows(tokenizer))
    config = DataConfig(max_prompt_length=6, on_bad_row="skip")
    assert eligible(pq.read_schema(path), config, scoring=False, routing=False) == TOKEN_IDS
    batches = list(pq.ParquetFile(path).iter_batches(batch_size=1024))
    taken = [batch_columns(b, TOKEN_IDS, 1024 * i, str(path), tokenizer, config) for i, b in enumerate(batches)]
    assert [t is not None for t in taken] == [True, True, False]
    assert taken[0].filtered_overlong > 0, "over-long rows dropped (filter)"
    assert not eligible(pq.read_schema(path), config, scoring=True, routing=False), "rows to score: row by row"
    text = _parquet(tmp_path / "many-text.parquet", _many_text_rows())
    assert eligible(pq.read_schema(text), config, scoring=False, routing=False) == TEXT
    batches = list(pq.ParquetFile(text).iter_batches(batch_size=1024))
    taken = [batch_columns(b, TEXT, 1024 * i, str(text), tokenizer, config) for i, b in enumerate(batches)]
    assert [t is not None for t in taken] == [True, True, False], "the empty response's batch: row by row"
    assert taken[0].mismatches, "joins that tokenize differently together are counted"
    strict = dataclasses.replace(config, tokenization_check="strict")
    assert not eligible(pq.read_schema(text), strict, scoring=False, routing=False), "strict: row by row"


def test_a_bad_row_in_error_mode_is_named_and_nothing_is_left_prepared(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "bad.jsonl", TEXT_ROWS)
    with pytest.raises(DataError, match=rf"{path}:6: the line is not valid JSON"):
        prepared_rows([path], tokenizer, DataConfig(max_prompt_length=24, max_response_length=24),
                      tmp_path / "prepared", say=lambda _: None)  # fmt: skip
    left = sorted(p.suffix for p in (tmp_path / "prepared").iterdir())
    assert left == [".failed", ".lock"], "no prepared directory, and why for those that waited"


def _prepare(paths: list[Path], tokenizer: HFTokenizer, config: DataConfig, root: Path):
    return prepared_rows(paths, tokenizer, config, root, say=lambda _: None)


def test_the_key_is_the_data_not_its_timestamps_nor_the_batching(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "rows.jsonl", [r for r in TEXT_ROWS[:4]])
    config, root = DataConfig(), tmp_path / "prepared"
    first = _prepare([path], tokenizer, config, root)
    assert first.how.startswith("prepared here")
    again = _prepare([path], tokenizer, dataclasses.replace(config, train_batch_size=8, seed=5), root)
    assert (again.how, again.directory) == ("prepared earlier", first.directory)
    os.utime(path, (1, 1))  # touched: the same data
    assert _prepare([path], tokenizer, config, root).directory == first.directory
    stat = path.stat()
    path.write_text(path.read_text().replace('"reward": 1.0', '"reward": 3.0'))  # same size, same mtime
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = _prepare([path], tokenizer, config, root)
    assert changed.directory != first.directory and changed.how.startswith("prepared here")
    assert changed.rows[0].reward == 3.0
    longer = _prepare([path], tokenizer, dataclasses.replace(config, max_response_length=8), root)
    assert longer.directory not in (first.directory, changed.directory)


def _hold_then_release(lock_path: str, ready, release) -> None:
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write("the test's holder")
        lock.flush()
        ready.set()
        release.wait(60)


def _prepare_in_child(paths, tokenizer_path, root, lines) -> None:
    data = prepared_rows(paths, load_tokenizer(tokenizer_path), DataConfig(), root, say=lines.put)
    lines.put(f"done: {data.how}")


def test_a_second_process_waits_for_the_preparer_and_prepares_if_it_died(tokenizer: HFTokenizer,
                                                                         tmp_path: Path) -> None:  # fmt: skip
    path = _jsonl(tmp_path / "rows.jsonl", TEXT_ROWS[:4])
    root = tmp_path / "prepared"
    probe = _prepare([path], tokenizer, DataConfig(), tmp_path / "probe")  # learn the key's folder name
    root.mkdir()
    context = mp.get_context("spawn")
    ready, release, lines = context.Event(), context.Event(), context.Queue()
    holder = context.Process(target=_hold_then_release,
                             args=(str(root / f"{probe.directory.name}.lock"), ready, release))  # fmt: skip
    holder.start()
    assert ready.wait(60)
    waiter = context.Process(target=_prepare_in_child, args=([path], tokenizer.path, root, lines))
    waiter.start()
    assert lines.get(timeout=60) == f"data: waiting for the test's holder to prepare {root / probe.directory.name}"
    (root / f"{probe.directory.name}.partial-deadhost-1").mkdir()  # what a killed preparer leaves
    release.set()  # the holder ends without preparing (as one that died): the waiter prepares itself
    holder.join(60)
    said = [lines.get(timeout=60) for _ in range(3)]
    waiter.join(60)
    assert said[0].startswith("data: preparing 1 file(s)") and said[-1].startswith("done: prepared here"), said
    assert sorted(p.name for p in root.iterdir()) == [probe.directory.name, f"{probe.directory.name}.lock"]


def _prepare_and_say_how_it_ended(paths, tokenizer_path, root, lines) -> None:
    try:
        _prepare_in_child(paths, tokenizer_path, root, lines)
    except DataError as error:
        lines.put(f"DataError: {error}")


def test_those_that_waited_for_a_preparer_stopped_by_its_data_stop_with_its_error(
    tokenizer: HFTokenizer, tmp_path: Path
) -> None:
    path = _jsonl(tmp_path / "rows.jsonl", TEXT_ROWS[:4])
    probe = _prepare([path], tokenizer, DataConfig(), tmp_path / "probe")  # the key's folder name
    root = tmp_path / "prepared"
    root.mkdir()
    context = mp.get_context("spawn")
    ready, release, lines = context.Event(), context.Event(), context.Queue()
    holder = context.Process(
        target=_hold_then_release, args=(str(root / f"{probe.directory.name}.lock"), ready, release)
    )
    holder.start()
    assert ready.wait(60)
    waiter = context.Process(target=_prepare_and_say_how_it_ended, args=([path], tokenizer.path, root, lines))
    waiter.start()
    assert lines.get(timeout=60).startswith("data: waiting for the test's holder")
    (root / f"{probe.directory.name}.failed").write_text(f"{path}:3: a bad row, as the preparer found it")
    release.set()
    assert lines.get(timeout=60) == f"DataError: {path}:3: a bad row, as the preparer found it", "not read again"
    waiter.join(60)
    holder.join(60)
    again = _prepare([path], tokenizer, DataConfig(), root)  # a later start did not wait: it prepares anew
    assert again.how.startswith("prepared here") and not (root / f"{probe.directory.name}.failed").exists()


def _prepare_slowly(path: str, tokenizer_path: str, root: str, scorer_file: str) -> None:
    scorer = build_scorer(RewardConfig(score_fn="custom", custom_fn=CustomRewardFnConfig(scorer_file, "slow")))
    prepared_rows([path], load_tokenizer(tokenizer_path), DataConfig(max_prompt_length=512), root, scorer,
                  say=lambda _: None)  # fmt: skip


def test_a_preparer_killed_midway_leaves_nothing_trusted(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    rows = [verl_row(i, f"What is {i}+1?", str(i + 1), f"#### {i + 1}") for i in range(300)]
    path = _parquet(tmp_path / "verl.parquet", rows)
    scorer_file = tmp_path / "slow.py"
    scorer_file.write_text("import time\ndef slow(data_source, solution_str, ground_truth, extra_info):\n"
                           "    time.sleep(0.01)\n    return 1.0\n")  # fmt: skip
    root = tmp_path / "prepared"
    child = mp.get_context("spawn").Process(target=_prepare_slowly,
                                            args=(str(path), tokenizer.path, str(root), str(scorer_file)))  # fmt: skip
    child.start()
    deadline = time.monotonic() + 60
    while not any(p.name.count(".partial-") and (p / "tokens.bin").exists() for p in root.glob("*")):
        assert time.monotonic() < deadline and child.is_alive()
        time.sleep(0.05)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert [p for p in root.iterdir() if "." not in p.name] == [], "no prepared directory under its final name"
    scorer = build_scorer(RewardConfig(score_fn="custom", custom_fn=CustomRewardFnConfig(str(scorer_file), "slow")))
    data = prepared_rows([path], tokenizer, DataConfig(max_prompt_length=512), root, scorer, say=lambda _: None)
    assert data.how.startswith("prepared here") and len(data.rows) == 300
    assert [p.name for p in root.iterdir() if ".partial-" in p.name] == [], "the killed preparer's files are gone"


def test_a_filesystem_without_locks_is_named_with_what_to_change(
    tokenizer: HFTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(A filesystem that refuses flock, as NFS without its lock daemon does, cannot be mounted here: the refusal
    is the kernel's ENOLCK, raised in its place.)"""
    import errno

    def refuse(*_) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", refuse)
    path = _jsonl(tmp_path / "rows.jsonl", TEXT_ROWS[:4])
    with pytest.raises(DataError, match=r"\.lock: the filesystem of data\.prepared_dir refuses file locks"):
        prepared_rows([path], tokenizer, DataConfig(), tmp_path / "prepared", say=lambda _: None)


def test_a_prepared_dir_that_cannot_be_written_is_named(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "rows.jsonl", TEXT_ROWS[:4])
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(DataError, match=r"data\.prepared_dir='.*a-file/prepared' cannot be written"):
        prepared_rows([path], tokenizer, DataConfig(), tmp_path / "a-file" / "prepared", say=lambda _: None)
