"""Real tokenizers: a SentencePiece model trained here and a Hugging Face tokenizer.json built here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from megatron_ppo.data.tokenizer import HFTokenizer, load_tokenizer, train_char_tokenizer
from megatron_ppo.tasks.addition.problems import corpus, split_problems


def test_char_sentencepiece_round_trips_the_addition_task(tmp_path: Path) -> None:
    train, heldout = split_problems(50, 10, seed=0)
    tokenizer = train_char_tokenizer(corpus(train + heldout), tmp_path / "tok.model")
    ids = tokenizer.encode("17+25=")
    assert len(ids) == 6, "one piece per character, no dummy-prefix space"
    assert tokenizer.decode([*tokenizer.encode("42"), tokenizer.eos_id]) == "42"
    assert load_tokenizer(tmp_path / "tok.model").vocab_size == tokenizer.vocab_size <= 16


def _hf_tokenizer(directory: Path, eos: str | None) -> Path:
    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(["hello world", "hello there"], trainers.WordLevelTrainer(
        special_tokens=["<unk>", "<pad>", "</s>"]))  # fmt: skip
    directory.mkdir()
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"eos_token": {"content": eos}, "pad_token": "<pad>"} if eos else {}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def test_hf_tokenizer_json_takes_end_and_pad_tokens_from_its_config(tmp_path: Path) -> None:
    tokenizer = load_tokenizer(_hf_tokenizer(tmp_path / "hf", "</s>"))
    assert isinstance(tokenizer, HFTokenizer)
    assert (tokenizer.eos_id, tokenizer.pad_id) == (2, 1)
    ids = tokenizer.encode("hello world")
    assert len(ids) == 2 and tokenizer.decode([*ids, tokenizer.eos_id]) == "hello world"


def test_hf_tokenizer_without_an_end_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="eos_token"):
        load_tokenizer(_hf_tokenizer(tmp_path / "hf", None))
