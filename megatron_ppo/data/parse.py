"""One dataset record → a `Row` of token ids: its fields, its tokens (from text or as given ids), its reward
(given, or scored from verl's columns), and the checks that reject it with a counted kind and a reason.

A record (a JSONL object or a Parquet row) gives its tokens as text or as ids:
    prompt              a string, or a list of chat messages {"role": str, "content": str}, rendered with the
                        tokenizer's chat_template (as `transformers`' apply_chat_template, with the generation
                        prompt) or, for a tokenizer without one, the built-in `<|role|>` format (see `chat.py`)
    response            a non-empty string; its ids are the tokenizer's encoding then eos
  or
    prompt_ids          token ids as the behaviour policy saw them: used as they are, nothing re-tokenized
    response_ids        the sampled token ids, as they are (eos included only if the sampler emitted it)
and
    reward              a finite number, the sequence score — or instead
    token_rewards       finite numbers, one per response token — or neither, when `reward.score_fn` scores the row
                        from verl's columns: data_source, reward_model.ground_truth, extra_info (see `scoring.py`)
    behavior_log_probs  optional: log-probs ≤ 0 of the behaviour policy, one per response token
    routed_experts      with actor.router_replay.mode=R3 (required then, read only then): the behaviour policy's
                        MoE routing, [token][layer][k] expert indices for every prompt and response token (the
                        last may be missing), as inference engines export it; checked against the model
    uid                 optional: GRPO group id (string or integer); default: the prompt (rows with the same prompt
                        tokens form one group)
    data_source         optional: a string; default ""
The prompt/response/reward names come from `DataConfig.*_key`; other columns are ignored, a null counts as absent,
and blank JSONL lines are not rows. For text rows the per-token lists have one entry per response token before
eos and get a 0.0 at the eos; for token-id rows they have one entry per `response_ids` entry.

Text rows are checked the way verl's `tokenization_sanity_check_mode` checks rollouts: the ids of prompt and
response tokenized apart (what is trained on) against the ids of prompt + response tokenized together. Where they
differ, `data.tokenization_check` rejects the row (strict), counts it in the report (warn), or is not asked (off).
A text row with `behavior_log_probs` must tokenize the same either way, whatever the mode: otherwise the sampled
tokens the log-probs belong to are not the ones trained on. Such data should come as token ids.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from megatron_ppo.config.schema import DataConfig
from megatron_ppo.data.chat import ChatTemplate, TemplateRefused, render_builtin_chat
from megatron_ppo.data.scoring import Scorer
from megatron_ppo.data.values import BadRow, RoutingShape, describe, finite_number, per_token, routed_experts, token_ids

TOKEN_REWARDS_KEY = "token_rewards"
BEHAVIOR_LOG_PROBS_KEY = "behavior_log_probs"
ROUTED_EXPERTS_KEY = "routed_experts"
UID_KEY = "uid"
DATA_SOURCE_KEY = "data_source"
PROMPT_IDS_KEY = "prompt_ids"
RESPONSE_IDS_KEY = "response_ids"
REWARD_MODEL_KEY = "reward_model"  # verl's layout: {"ground_truth": ..., "style": "rule"}
GROUND_TRUTH_KEY = "ground_truth"
EXTRA_INFO_KEY = "extra_info"


class Tokenizer(Protocol):
    """What the reader needs of a tokenizer: text ↔ ids, its vocabulary size, the id appended after every text
    response, and its chat template (None: chat prompts use the built-in format)."""

    eos_id: int
    unk_id: int | None  # the id of text outside the vocabulary; None: the tokenizer has none (byte-level)
    chat_template: ChatTemplate | None

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


@dataclass(frozen=True)
class Row:
    """One kept row in token ids. The per-token lists, when present, have one entry per `response_ids` entry."""

    prompt_ids: list[int]
    response_ids: list[int]  # text rows: the response's tokens then eos (the eos may be cut by truncation)
    reward: float | None  # sequence score; None when token_rewards are given
    token_rewards: list[float] | None
    behavior_log_probs: list[float] | None
    uid: str
    data_source: str
    source: str  # "path:line" (JSONL, 1-based) or "path:row N" (Parquet, 0-based)
    # [prompt + response tokens (or one fewer), layers, k] int32: the behaviour policy's experts (R3 only)
    routed_experts: Any = None
    # verl's `reward_model.ground_truth` and `extra_info`, when given: what evaluation scores a fresh response with
    ground_truth: Any = None
    extra_info: dict[str, Any] | None = None


@dataclass(frozen=True)
class ParsedRow:
    """A valid row and what reading it involved, for the report."""

    row: Row
    scored: bool
    builtin_chat: bool
    mismatch: str | None  # the warn-mode tokenization difference, described
    unknown: str | None = None  # the characters outside the tokenizer's vocabulary (not strict mode), described


@dataclass(frozen=True)
class _Tokens:
    """A row's ids, the response text a scorer reads, and what the per-token lists are counted against."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_text: str | None  # None: token-id row without a response column (decoded when scored)
    num_per_token: int  # entries each per-token list must have
    counted: str  # which tokens those are, for messages
    appends_eos: bool  # text rows: the per-token lists get 0.0 at the appended eos
    builtin_chat: bool
    apart_vs_together: str | None  # how the ids differ tokenized apart vs together; None: same or not checked
    unknown: str | None = None  # text rows: the characters that became the unknown token, described


def parse_row(
    record: Any,
    source: str,
    tokenizer: Tokenizer,
    config: DataConfig,
    scorer: Scorer | None,
    routing: RoutingShape | None = None,
) -> ParsedRow:
    """`record` checked and tokenized; with `routing` (R3), also its `routed_experts` against the model."""
    if not isinstance(record, dict):
        raise BadRow(
            "not_object",
            f"the row is {describe(record)}; expected an object with keys such as "
            f"'{config.prompt_key}', '{config.response_key}', '{config.reward_key}' "
            f"(or '{PROMPT_IDS_KEY}', '{RESPONSE_IDS_KEY}')",
        )
    token_id_row = record.get(PROMPT_IDS_KEY) is not None or record.get(RESPONSE_IDS_KEY) is not None
    text_fields = None if token_id_row else _text_fields(record, config)
    reward, has_token_rewards = _given_reward(record, config, scorer)
    if text_fields is None:
        tokens = _token_id_tokens(record, tokenizer, config)
    else:
        tokens = _text_tokens(*text_fields, tokenizer, config, record.get(BEHAVIOR_LOG_PROBS_KEY) is not None)
    token_rewards = per_token(record, TOKEN_REWARDS_KEY, tokens.num_per_token, tokens.counted)
    behavior_log_probs = per_token(record, BEHAVIOR_LOG_PROBS_KEY, tokens.num_per_token, tokens.counted)
    if behavior_log_probs is not None:
        positive = next((i for i, lp in enumerate(behavior_log_probs) if lp > 0), None)
        if positive is not None:
            raise BadRow(
                "positive_log_prob",
                f"'{BEHAVIOR_LOG_PROBS_KEY}'[{positive}] = {behavior_log_probs[positive]} is > 0; expected "
                "log-probabilities ≤ 0",
            )
    if tokens.apart_vs_together is not None and (
        behavior_log_probs is not None or config.tokenization_check == "strict"
    ):
        ids = f"give the sampled ids as '{PROMPT_IDS_KEY}'/'{RESPONSE_IDS_KEY}'"
        why, fix = (
            (f"'{BEHAVIOR_LOG_PROBS_KEY}' belong to the sampled tokens, which re-tokenizing does not reproduce", ids)
            if behavior_log_probs is not None
            else ("data.tokenization_check=strict", f"{ids}, or set data.tokenization_check=warn to keep the ids apart")
        )
        raise BadRow(
            "tokenization_mismatch", f"{tokens.apart_vs_together} ({why}); expected the same ids either way: {fix}"
        )
    data_source = _data_source(record.get(DATA_SOURCE_KEY))
    scored = reward is None and not has_token_rewards
    if scored:
        assert scorer is not None  # _given_reward refused the row otherwise
        response = tokens.response_text
        if response is None:
            response = tokenizer.decode(tokens.response_ids)
        reward = _score(record, data_source, response, scorer)
    eos = [0.0] if tokens.appends_eos else []
    num_tokens = len(tokens.prompt_ids) + len(tokens.response_ids)
    routes = None if routing is None else routed_experts(record, ROUTED_EXPERTS_KEY, routing, num_tokens)
    row = Row(
        prompt_ids=tokens.prompt_ids,
        response_ids=tokens.response_ids,
        reward=reward,
        token_rewards=None if token_rewards is None else [*token_rewards, *eos],
        behavior_log_probs=None if behavior_log_probs is None else [*behavior_log_probs, *eos],
        uid=_uid(record.get(UID_KEY), tokens.prompt_ids),
        data_source=data_source,
        source=source,
        routed_experts=routes,
        ground_truth=_ground_truth(record),
        extra_info=record.get(EXTRA_INFO_KEY) if isinstance(record.get(EXTRA_INFO_KEY), dict) else None,
    )
    mismatch = tokens.apart_vs_together if config.tokenization_check == "warn" else None
    return ParsedRow(row, scored=scored, builtin_chat=tokens.builtin_chat, mismatch=mismatch, unknown=tokens.unknown)


def row_tokens(record: Any, tokenizer: Tokenizer, config: DataConfig) -> tuple[list[int], list[int]]:
    """The prompt and response ids `parse_row` trains a record on (text tokenized, eos appended; ids as given), with
    the checks of its fields, without reading its reward: what a reward model scores (`megatron-ppo score`)."""
    if not isinstance(record, dict):
        raise BadRow("not_object", f"the row is {describe(record)}; expected an object")
    if record.get(PROMPT_IDS_KEY) is not None or record.get(RESPONSE_IDS_KEY) is not None:
        tokens = _token_id_tokens(record, tokenizer, config)
    else:
        tokens = _text_tokens(*_text_fields(record, config), tokenizer, config, has_log_probs=False)
    return tokens.prompt_ids, tokens.response_ids


def _text_fields(record: dict[str, Any], config: DataConfig) -> tuple[Any, str]:
    prompt = _required(record, config.prompt_key)
    _check_messages(prompt, config.prompt_key)
    response = _required(record, config.response_key)
    if not isinstance(response, str):
        raise BadRow("wrong_type", f"'{config.response_key}' is {describe(response)}; expected a string")
    return prompt, response


def _given_reward(record: dict[str, Any], config: DataConfig, scorer: Scorer | None) -> tuple[float | None, bool]:
    """(the sequence reward, whether token rewards are given); both empty means the scorer gives the reward."""
    reward, token_rewards = record.get(config.reward_key), record.get(TOKEN_REWARDS_KEY)
    if reward is None and token_rewards is None and scorer is None:
        raise BadRow(
            "missing_reward",
            f"neither '{config.reward_key}' nor '{TOKEN_REWARDS_KEY}' is given; expected a sequence reward (a number) "
            "or a list of per-token rewards, or set reward.score_fn (verl | custom) to score rows without one",
        )
    if reward is not None and token_rewards is not None:
        raise BadRow(
            "ambiguous_reward",
            f"both '{config.reward_key}' and '{TOKEN_REWARDS_KEY}' are given; expected exactly one of them",
        )
    return (None if reward is None else finite_number(reward, f"'{config.reward_key}'")), token_rewards is not None


def _text_tokens(prompt: Any, response: str, tokenizer: Tokenizer, config: DataConfig, has_log_probs: bool) -> _Tokens:
    prompt_text, builtin_chat = render_prompt(prompt, tokenizer)
    response_tokens = tokenizer.encode(response) if response else []
    if not response_tokens:
        raise BadRow(
            "empty_response",
            f"'{config.response_key}' ({describe(response)}) has no tokens; expected a non-empty response",
        )
    prompt_ids = tokenizer.encode(prompt_text)
    if not prompt_ids:
        raise BadRow(
            "empty_prompt",
            f"'{config.prompt_key}' has no tokens; expected a non-empty prompt (the first "
            "response token is predicted from it)",
        )
    difference = None
    if config.tokenization_check != "off" or has_log_probs:
        difference = apart_vs_together(prompt_ids + response_tokens, tokenizer.encode(prompt_text + response))
    unknown = _unknown_characters(prompt_text, response, prompt_ids + response_tokens, tokenizer)
    if unknown is not None and config.tokenization_check == "strict":
        raise BadRow(
            "unknown_characters",
            f"{unknown} (data.tokenization_check=strict); expected text the tokenizer represents: use its "
            "tokenizer, clean the data, or set data.tokenization_check=warn to train on the unknown token",
        )
    return _Tokens(
        prompt_ids=prompt_ids,
        response_ids=[*response_tokens, tokenizer.eos_id],
        response_text=response,
        num_per_token=len(response_tokens),
        counted="eos not included",
        appends_eos=True,
        builtin_chat=builtin_chat,
        apart_vs_together=difference,
        unknown=unknown,
    )


def _unknown_characters(prompt: str, response: str, ids: list[int], tokenizer: Tokenizer) -> str | None:
    """Where the tokenizer turned characters outside its vocabulary into its unknown token: which characters, and
    in which part; None when no id is the unknown token."""
    unk = tokenizer.unk_id
    if unk is None or unk not in ids:
        return None
    parts = [(name, sorted({c for c in text if tokenizer.encode(c) == [unk]})) for name, text in
             (("prompt", prompt), ("response", response))]  # fmt: skip
    found = "; ".join(f"{name} {''.join(chars)!r}" for name, chars in parts if chars) or "characters"
    return (f"{ids.count(unk)} tokens are the tokenizer's unknown token (id {unk}), from text outside its "
            f"vocabulary: {found}")  # fmt: skip


def apart_vs_together(apart: list[int], together: list[int]) -> str | None:
    """None when the ids are equal, else where they first differ."""
    if apart == together:
        return None
    i = next(
        (i for i, (a, b) in enumerate(zip(apart, together, strict=False)) if a != b), min(len(apart), len(together))
    )
    return (
        f"prompt and response tokenize to {len(apart)} ids apart but {len(together)} together, first differing at "
        f"token {i} (apart {apart[i : i + 3]}, together {together[i : i + 3]})"
    )


def _token_id_tokens(record: dict[str, Any], tokenizer: Tokenizer, config: DataConfig) -> _Tokens:
    prompt_ids = token_ids(record, PROMPT_IDS_KEY, tokenizer.vocab_size)
    response_ids = token_ids(record, RESPONSE_IDS_KEY, tokenizer.vocab_size)
    response = record.get(config.response_key)
    if response is not None and not isinstance(response, str):
        raise BadRow("wrong_type", f"'{config.response_key}' is {describe(response)}; expected a string (or none)")
    return _Tokens(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_text=response,
        num_per_token=len(response_ids),
        counted=f"one per '{RESPONSE_IDS_KEY}' entry",
        appends_eos=False,
        builtin_chat=False,
        apart_vs_together=None,
    )


def _ground_truth(record: dict[str, Any]) -> Any:
    reward_model = record.get(REWARD_MODEL_KEY)
    return reward_model.get(GROUND_TRUTH_KEY) if isinstance(reward_model, dict) else None


def _score(record: dict[str, Any], data_source: str, response: str, scorer: Scorer) -> float:
    """The scorer's reward from verl's columns `reward_model.ground_truth` and `extra_info`."""
    reward_model = record.get(REWARD_MODEL_KEY)
    ground_truth = reward_model.get(GROUND_TRUTH_KEY) if isinstance(reward_model, dict) else None
    if ground_truth is None:
        raise BadRow(
            "missing_ground_truth",
            f"the row has no reward and no '{REWARD_MODEL_KEY}.{GROUND_TRUTH_KEY}' (found '{REWARD_MODEL_KEY}' = "
            f"{describe(reward_model)}); expected verl's layout {{'{GROUND_TRUTH_KEY}': ...}} for {scorer.name}",
        )
    extra_info = record.get(EXTRA_INFO_KEY)
    if extra_info is not None and not isinstance(extra_info, dict):
        raise BadRow("wrong_type", f"'{EXTRA_INFO_KEY}' is {describe(extra_info)}; expected an object (or none)")
    try:
        return scorer(data_source, response, ground_truth, extra_info or {})
    except Exception as e:  # the scorer is user or verl code: any failure rejects this row with its reason
        raise BadRow(
            "score_failed",
            f"{scorer.name} could not score the row ({type(e).__name__}: {e}); expected a data_source and "
            "ground truth it scores",
        ) from None


def _required(record: dict[str, Any], key: str) -> Any:
    value = record.get(key)
    if value is None and key in record:
        raise BadRow("missing_field", f"'{key}' is null; expected a '{key}' value, not null")
    if value is None:
        present = ", ".join(f"'{k}'" for k in list(record)[:8]) or "none"
        raise BadRow("missing_field", f"'{key}' is missing (keys present: {present}); expected a '{key}' column")
    return value


def _check_messages(prompt: Any, key: str) -> None:
    if isinstance(prompt, str):
        return
    if not isinstance(prompt, list) or not prompt:
        raise BadRow(
            "wrong_type",
            f"'{key}' is {describe(prompt)}; expected a string or a non-empty list of chat "
            "messages {'role': str, 'content': str}",
        )
    for i, message in enumerate(prompt):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise BadRow(
                "wrong_type",
                f"'{key}' message {i} is {describe(message)}; expected a chat message {{'role': str, 'content': str}}",
            )


def render_prompt(prompt: str | list[dict[str, Any]], tokenizer: Tokenizer) -> tuple[str, bool]:
    """(the prompt text, whether the built-in chat format rendered it)."""
    if isinstance(prompt, str):
        return prompt, False
    template = tokenizer.chat_template
    if template is None:
        return render_builtin_chat(prompt), True
    try:
        return template.render(prompt), False
    except TemplateRefused as e:
        raise BadRow(
            "chat_template_error",
            f"the chat_template of {template.origin} refused the messages ({e}); expected messages it accepts",
        ) from None


def prompt_group(prompt_ids: Sequence[int] | np.ndarray) -> str:
    """The GRPO group of a row without a `uid`: its prompt, as a digest of the prompt's ids (64-bit little-endian,
    so that a list and an array of the same ids are one group)."""
    return "prompt:" + hashlib.blake2b(np.asarray(prompt_ids, dtype="<i8").tobytes(), digest_size=8).hexdigest()


def _uid(uid: Any, prompt_ids: list[int]) -> str:
    """The row's GRPO group: its `uid`, else its prompt (`prompt_group`)."""
    if uid is None:
        return prompt_group(prompt_ids)
    if isinstance(uid, bool) or not isinstance(uid, str | int):
        raise BadRow("wrong_type", f"'{UID_KEY}' is {describe(uid)}; expected a string or an integer group id")
    return str(uid)


def _data_source(data_source: Any) -> str:
    if data_source is None:
        return ""
    if not isinstance(data_source, str):
        raise BadRow("wrong_type", f"'{DATA_SOURCE_KEY}' is {describe(data_source)}; expected a string")
    return data_source


def prompt_kept(length: int, limit: int, side: str) -> tuple[slice, ...]:
    """The spans of a prompt of `length` tokens that truncation to `limit` keeps, as verl's `data.truncation` keeps
    them (`verl.utils.torch_functional.postprocess_data`): left the last `limit`, right the first `limit`, middle the
    first ⌊limit/2⌋ and the last ⌈limit/2⌉; the whole prompt when it fits."""
    if length <= limit:
        return (slice(0, length),)
    if side == "left":
        return (slice(length - limit, length),)
    if side == "right":
        return (slice(0, limit),)
    head = limit // 2
    return slice(0, head), slice(length - (limit - head), length)
