"""Preference pairs as data: a record with a chosen and a rejected response to one prompt becomes two rows, one group.

A pair record holds `data.prompt_key` (text or chat messages, as any row), `data.chosen_key` and `data.rejected_key`
(the two responses, text) and, for `data.pair_reward=given`, `data.chosen_score_key` and `data.rejected_score_key`
(UltraFeedback's scores). It becomes two records, the chosen one first, sharing the pair's group id (`uid`: the
record's own, else "pair:<file:line>"), each with `data.response_key` = its response and `pair` = "chosen" or
"rejected"; every other column is kept as it was, the four pair columns are dropped. Their `data.reward_key`:

    given       the score columns, as given
    preference  +1 for the chosen response, −1 for the rejected one (the pair's order, no margin)
    model       none: a reward model scores them (`megatron-ppo score`); a training run refuses such a pair
"""

from __future__ import annotations

from typing import Any

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.values import BadRow, describe, finite_number

PAIR_SIDE_KEY = "pair"
SIDES = ("chosen", "rejected")
PREFERENCE_REWARDS = {"chosen": 1.0, "rejected": -1.0}


def is_pair(record: Any, config: DataConfig) -> bool:
    """Whether `record` is a preference pair (it has a chosen or a rejected response)."""
    return isinstance(record, dict) and any(record.get(key) is not None for key in _response_keys(config))


def expand_records(record: Any, source: str, config: DataConfig, scoring: bool = False) -> list[tuple[str, Any]]:
    """(source, record) for each row `record` stands for: itself, or a pair's two (sources "<source> (chosen)" and
    "<source> (rejected)"). Raises `BadRow` for a malformed pair, and for a pair a reward model must score
    (`pair_reward=model`) outside `scoring` (`megatron-ppo score`)."""
    if not is_pair(record, config):
        return [(source, record)]
    if config.pair_reward == "model" and not scoring:
        raise BadRow(
            "unscored_pair",
            f"a preference pair ('{config.chosen_key}', '{config.rejected_key}') with data.pair_reward=model: its "
            "rewards come from a reward model; score the file first (`megatron-ppo score RECIPE` with "
            "reward_model.model.path) and train on the scored file, or set data.pair_reward=given (score columns) "
            "or preference (+1/−1)",
        )
    keys = dict(zip(SIDES, _response_keys(config), strict=True))
    score_keys = {"chosen": config.chosen_score_key, "rejected": config.rejected_score_key}
    for side, key in keys.items():
        response = record.get(key)
        if not isinstance(response, str):
            raise BadRow(
                "wrong_type" if response is not None else "missing_field",
                f"the pair's '{key}' is {describe(response)}; expected the {side} response as a string",
            )
    if config.reward_key in record and record[config.reward_key] is not None:
        raise BadRow(
            "ambiguous_reward",
            f"a preference pair with a '{config.reward_key}' column: one reward cannot belong to both responses; "
            f"give '{config.chosen_score_key}' and '{config.rejected_score_key}' (data.pair_reward=given)",
        )
    uid = record.get("uid")
    group = f"pair:{source}" if uid is None else uid
    kept = {k: v for k, v in record.items() if k not in (*keys.values(), *score_keys.values())}
    rows = []
    for side, key in keys.items():
        row = {**kept, config.response_key: record[key], "uid": group, PAIR_SIDE_KEY: side}
        if config.pair_reward == "given":
            row[config.reward_key] = finite_number(record.get(score_keys[side]), f"the pair's '{score_keys[side]}'")
        elif config.pair_reward == "preference":
            row[config.reward_key] = PREFERENCE_REWARDS[side]
        rows.append((f"{source} ({side})", row))
    return rows


def of_side(bad: BadRow, where: str, source: str) -> BadRow:
    """`bad`, raised by one row of the record at `source`, saying which of a pair's rows it is (`where`)."""
    return bad if where == source else BadRow(bad.kind, f"the pair's {where.removeprefix(source).strip()} row: "
                                              f"{bad.problem}")  # fmt: skip


def _response_keys(config: DataConfig) -> tuple[str, str]:
    return config.chosen_key, config.rejected_key
