"""Chat prompts rendered with the tokenizer's own chat template equal `transformers`' `apply_chat_template(...,
add_generation_prompt=True)` byte for byte (and in token ids); without a template the built-in format is used and
reported."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
import transformers

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data import DataError, read_rows, render_builtin_chat
from megatron_ppo.data.tokenizer import load_tokenizer
from tests.support.data_fixtures import CHATML, tokenizer_dir
from tests.support.fresh_process import assert_in_a_fresh_process

CONVERSATIONS = {
    "user": [{"role": "user", "content": "What is 2+3?"}],
    "system": [{"role": "system", "content": "Answer with the number only."}, {"role": "user", "content": "12 + 30?"}],
    "multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello there!"},
        {"role": "assistant", "content": '  Hi! <b>How</b> are you? "fine" & é  '},
        {"role": "tool", "content": "ignored by one template"},
        {"role": "user", "content": "What is 2+3?\n\nThe answer is"},
    ],
}


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {style: tokenizer_dir(root / style, style) for style in ("chatml", "llama3", "environment", "none")}


def _hf(directory: Path):
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("style", ["chatml", "llama3", "environment"])
def test_prompts_equal_transformers_apply_chat_template(directories: dict[str, Path], style: str) -> None:
    ours, theirs = load_tokenizer(directories[style]), _hf(directories[style])
    assert ours.chat_template is not None
    for name, messages in CONVERSATIONS.items():
        expected = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rendered = ours.chat_template.render(messages)
        assert rendered == expected, f"{style}/{name}: ours {rendered!r} != transformers {expected!r}"
        expected_ids = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert ours.encode(rendered) == expected_ids, f"{style}/{name}: the rendered prompt tokenizes differently"


def test_rows_with_chat_prompts_get_the_template_ids(directories: dict[str, Path], tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": m, "response": "5", "reward": 1}) + "\n" for m in CONVERSATIONS.values())
    )
    theirs = _hf(directories["llama3"])
    rows, report = read_rows([path], load_tokenizer(directories["llama3"]), DataConfig(max_prompt_length=512))
    for row, messages in zip(rows, CONVERSATIONS.values(), strict=True):
        assert row.prompt_ids == theirs.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert report.builtin_chat_prompts == 0 and "built-in" not in report.summary()


def test_a_template_file_beside_the_tokenizer_wins_as_in_transformers(
    directories: dict[str, Path], tmp_path: Path
) -> None:
    directory = tmp_path / "file"
    shutil.copytree(directories["llama3"], directory)
    (directory / "chat_template.jinja").write_text(CHATML)
    messages = CONVERSATIONS["system"]
    expected = _hf(directory).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert expected.startswith("<|im_start|>system")
    assert load_tokenizer(directory).chat_template.render(messages) == expected


def test_named_templates_use_the_default_one(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": CHATML}]
    directory = tokenizer_dir(tmp_path / "named", "chatml", chat_template=named)
    messages = CONVERSATIONS["user"]
    expected = _hf(directory).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert load_tokenizer(directory).chat_template.render(messages) == expected
    without_default = tokenizer_dir(tmp_path / "no_default", "chatml", chat_template=named[:1])
    with pytest.raises(ValueError, match="none named 'default'"):
        load_tokenizer(without_default)


def test_jinja2_is_imported_with_the_first_template_not_by_the_trainer(tmp_path: Path) -> None:
    """A worker whose tokenizer has no template (the tiny recipe's) never imports jinja2 (~0.16 CPU-s)."""
    directory = tokenizer_dir(tmp_path / "chatml", "chatml")
    assert_in_a_fresh_process(
        "import sys",
        "import megatron_ppo.train.run",
        "assert 'jinja2' not in sys.modules, 'the trainer imported jinja2'",
        "from megatron_ppo.data.tokenizer import load_tokenizer",
        f"assert load_tokenizer({str(directory)!r}).chat_template is not None and 'jinja2' in sys.modules",
    )


def test_invalid_jinja_is_refused_naming_the_file(tmp_path: Path) -> None:
    directory = tokenizer_dir(tmp_path / "bad", "chatml", chat_template="{% for m in messages %}")
    with pytest.raises(ValueError, match=r"tokenizer_config\.json: the chat_template is not valid Jinja"):
        load_tokenizer(directory)


def test_a_conversation_the_template_refuses_is_a_bad_row(directories: dict[str, Path], tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(jinja2.TemplateError, match="must not be the assistant"):
        _hf(directories["environment"]).apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": messages, "response": "5", "reward": 1}) + "\n")
    with pytest.raises(DataError, match=r"rows\.jsonl:1: the chat_template of .* refused the messages \(the last"):
        read_rows([path], load_tokenizer(directories["environment"]), DataConfig(max_prompt_length=512))


def test_without_a_template_the_builtin_format_is_used_and_reported(
    directories: dict[str, Path], tmp_path: Path
) -> None:
    tokenizer = load_tokenizer(directories["none"])
    assert tokenizer.chat_template is None
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "response": "5", "reward": 1}) + "\n"
                            for p in [CONVERSATIONS["system"], "What is 2+3?"]))  # fmt: skip
    rows, report = read_rows([path], tokenizer, DataConfig(max_prompt_length=512))
    assert rows[0].prompt_ids == tokenizer.encode(render_builtin_chat(CONVERSATIONS["system"]))
    assert report.builtin_chat_prompts == 1
    assert "1 chat prompts rendered in the built-in <|role|> format (the tokenizer has no chat_template)" in (
        report.summary()
    )
