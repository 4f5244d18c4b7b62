"""Rows in verl's RL Parquet layout without a reward are scored at load time by verl's `default_compute_score` or a
user function, with the rewards verl's scorer gives; a row that cannot be scored is rejected with its reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import CustomRewardFnConfig, DataConfig, PPOConfig, RewardConfig
from megatron_ppo.config.validate import validate
from megatron_ppo.data import DataError, build_scorer, read_rows
from megatron_ppo.data.tokenizer import HFTokenizer, load_tokenizer
from tests.support.data_fixtures import GSM8K, INSTRUCTION, tokenizer_dir, verl_row


def _write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return load_tokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok") / "chatml", "chatml"))


def _config(**overrides) -> DataConfig:
    return DataConfig(max_prompt_length=512, max_response_length=512, **overrides)


def test_verl_layout_rows_get_verls_gsm8k_rewards(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    from verl.utils.reward_score import default_compute_score

    rows = [verl_row(i, *example) for i, example in enumerate(GSM8K)]
    given = {**verl_row(4, "What is 2+3?", "5", "#### 5"), "reward": 0.25}
    unknown = verl_row(5, "What is 2+3?", "5", "#### 5", data_source="my/unknown")
    no_truth = {**verl_row(6, "What is 2+3?", "5", "#### 5"), "reward_model": {"style": "rule", "ground_truth": None}}
    path = _write_parquet(tmp_path / "gsm8k.parquet", [*rows, given, unknown, no_truth])
    scorer = build_scorer(RewardConfig(score_fn="verl"))
    kept, report = read_rows([path], tokenizer, _config(on_bad_row="skip"), tmp_path / "rejects.jsonl", scorer)

    expected = [default_compute_score("openai/gsm8k", response, answer) for _, answer, response in GSM8K]
    assert expected == [1.0, 0.0, 0.0, 1.0], "the examples cover a right, a wrong, a missing and a 1,000 answer"
    assert [row.reward for row in kept] == [*expected, 0.25], "a row with a reward keeps it"
    assert [row.data_source for row in kept] == ["openai/gsm8k"] * 5
    messages = [{"role": "user", "content": GSM8K[0][0] + INSTRUCTION}]
    assert kept[0].prompt_ids == tokenizer.encode(tokenizer.chat_template.render(messages))
    assert (report.scored, report.rejected) == (4, 2)
    assert report.reasons == {"score_failed": 1, "missing_ground_truth": 1}
    assert "scored 4 rows with verl.utils.reward_score.default_compute_score" in report.summary()
    with pytest.raises(DataError, match=r"gsm8k\.parquet:row 5: verl\.utils\.reward_score\.default_compute_score "
                                        r"could not score the row \(NotImplementedError: .*my/unknown"):  # fmt: skip
        read_rows([path], tokenizer, _config(), scorer=scorer)


def test_without_a_scorer_a_row_without_reward_is_refused(tokenizer: HFTokenizer, tmp_path: Path) -> None:
    path = _write_parquet(tmp_path / "gsm8k.parquet", [verl_row(0, *GSM8K[0])])
    with pytest.raises(DataError, match=r"row 0: neither 'reward' nor 'token_rewards' is given.*reward\.score_fn"):
        read_rows([path], tokenizer, _config())


CUSTOM = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip().endswith(ground_truth)) + extra_info["bonus"], "acc": 1.0}


def not_a_number(data_source, solution_str, ground_truth, extra_info=None):
    return float("nan")
"""


def test_a_custom_function_scores_text_and_token_id_rows_as_verl_calls_it(
    tokenizer: HFTokenizer, tmp_path: Path
) -> None:
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    text = {**verl_row(0, *GSM8K[0]), "extra_info": {"bonus": 0.5}, "prompt_ids": None, "response_ids": None}
    ids = {**text, "prompt": None, "response": None, "prompt_ids": tokenizer.encode("What is 2+3?"),
           "response_ids": tokenizer.encode("so #### 72"), "extra_info": {"bonus": 0.25}}  # fmt: skip
    path = _write_parquet(tmp_path / "rows.parquet", [text, ids])
    reward = RewardConfig(score_fn="custom", custom_fn=CustomRewardFnConfig(str(tmp_path / "my_reward.py")))
    rows, report = read_rows([path], tokenizer, _config(), scorer=build_scorer(reward))
    assert [row.reward for row in rows] == [1.5, 1.25], "the token-id row is scored on its decoded response"
    assert report.scored == 2

    reward.custom_fn.name = "not_a_number"
    with pytest.raises(DataError, match=r"row 0: not_a_number from .* could not score the row \(ScoreError: .* "
                                        r"returned nan; expected a finite number"):  # fmt: skip
        read_rows([path], tokenizer, _config(), scorer=build_scorer(reward))


def test_scorers_that_cannot_be_built_say_what_to_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_scorer(RewardConfig()) is None
    missing = RewardConfig(score_fn="custom", custom_fn=CustomRewardFnConfig(str(tmp_path / "nowhere.py")))
    with pytest.raises(ConfigError, match=r"reward\.custom_fn\.path=.*nowhere\.py' is not a file"):
        build_scorer(missing)
    (tmp_path / "my_reward.py").write_text(CUSTOM)
    misnamed = RewardConfig(score_fn="custom", custom_fn=CustomRewardFnConfig(str(tmp_path / "my_reward.py"), "score"))
    with pytest.raises(ConfigError, match=r"'score' is not a function in .* \['compute_score', 'not_a_number'\]"):
        build_scorer(misnamed)
    monkeypatch.setitem(sys.modules, "verl.utils.reward_score", None)  # as where verl is not installed
    with pytest.raises(ConfigError, match=r"reward\.score_fn='verl' needs verl.*pip install -e '\.\[verl\]'"):
        build_scorer(RewardConfig(score_fn="verl"))


def test_validation_refuses_reward_and_tokenization_keys_that_would_do_nothing() -> None:
    config = PPOConfig()
    config.reward.score_fn = "custom"
    config.data.tokenization_check = "sometimes"
    problems = validate(config)
    assert any("reward.score_fn='custom' needs reward.custom_fn.path" in p for p in problems), problems
    assert any("data.tokenization_check='sometimes' is not one of 'strict', 'warn', 'off'" in p for p in problems)
    config = PPOConfig()
    config.reward.score_fn = "rule"
    problems = validate(config)
    assert any("reward.score_fn='rule' is not one of None, 'verl', 'custom'" in p for p in problems), problems
    config = PPOConfig()
    config.reward.custom_fn.path, config.reward.score_fn = "my_reward.py", "verl"
    problems = validate(config)
    assert any("reward.custom_fn.path='my_reward.py' is set but reward.score_fn='verl'" in p for p in problems)
    config = PPOConfig()
    config.reward.score_fn, config.data.task = "verl", "addition"
    assert validate(config) == [
        "reward.score_fn='verl' scores rows without a reward, but data.task='addition' writes its rewards into its "
        "rows; unset reward.score_fn"
    ]


def test_verl_custom_reward_function_keys_select_the_custom_scorer(tmp_path: Path) -> None:
    """verl's `custom_reward_function.path/name` land on reward.custom_fn, and a path alone selects it (as in
    verl, where a given custom_reward_function is used)."""
    from megatron_ppo.config import load_config

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
    config = load_config(recipe, ["data.task=null", "model.allow_random_init=true",
                                  f"custom_reward_function.path={tmp_path / 'my_reward.py'}",
                                  "custom_reward_function.name=score"])  # fmt: skip
    assert (config.reward.score_fn, config.reward.custom_fn.name) == ("custom", "score")
    assert config.reward.custom_fn.path == str(tmp_path / "my_reward.py")
