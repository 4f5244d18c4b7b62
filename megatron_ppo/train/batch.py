"""Token batches: rows of (prompt, response) as right-padded tensors, and micro-batch slices of them.

For a row with P prompt and R response tokens, `input_ids` holds the P + R tokens then padding; `labels[t]` is
`input_ids[t + 1]`; `loss_mask[t]` is 1 where `labels[t]` is a response token, i.e. t ∈ [P − 1, P + R − 2].
Every per-token quantity of the algorithm (log-probs, values, rewards, advantages) lives at these label positions,
shape `[rows, max_len]`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NotRequired, TypedDict

import torch

from megatron_ppo.algo.advantages import GROUPED_ESTIMATORS
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.data.batching import (
    EpochSampler,
    GroupSampler,
    dynamic_micro_batches,
    fixed_micro_batches,
    group_rows,
    packed_micro_batches,
)
from megatron_ppo.data.prepared import column
from megatron_ppo.data.rows import Row
from megatron_ppo.models.packing import segment_lengths
from megatron_ppo.models.router_replay import record_dtype
from megatron_ppo.parallel.collectives import data_parallel_share, dynamic_micro_batch_count


class Batch(TypedDict):
    """A PPO batch of R rows, W = the longest prompt + response among them."""

    input_ids: torch.Tensor  # [R, W] long: prompt then response tokens, right-padded
    labels: torch.Tensor  # [R, W] long: input_ids shifted left by one
    loss_mask: torch.Tensor  # [R, W] float: 1 where the label is a response token (verl's response_mask)
    position_ids: torch.Tensor  # [R, W] long
    lengths: torch.Tensor  # [R] long: prompt + response tokens
    scores: torch.Tensor  # [R] float: sequence reward; NaN where the row gives token rewards
    token_level_scores: torch.Tensor  # [R, W] float: the row's token rewards at their label positions, else 0
    group: torch.Tensor  # [R] long: dense GRPO group ids of the rows' uids
    behavior_log_prob: NotRequired[torch.Tensor]  # [R, W] float: the behaviour policy's log-probs, when rows have them
    behavior_rows: NotRequired[torch.Tensor]  # [R] bool: the rows that carry them (the others hold zeros)
    # [R, W, L, K] the behaviour policy's experts + 1 per input token and layer, 0 where none (R3;
    # `models.router_replay`)
    routed_experts: NotRequired[torch.Tensor]


def collate(rows: Sequence[Row], pad_id: int) -> Batch:
    """input_ids, labels, loss_mask, position_ids, lengths, sequence scores (`scores`, NaN where the row gives
    token rewards), `token_level_scores` (the token rewards at their label positions, else zeros), `group` (dense
    uid ids for GRPO) and, when any row has them, `behavior_log_prob` with `behavior_rows`.

    Built with masks over the [R, W] grid, not row by row: row r's tokens fill the columns t < P_r + R_r, its label
    positions are P_r − 1 ≤ t < P_r + R_r − 1, and a boolean mask assigns a flat list in row-major order, so the
    rows' concatenated ids (or per-token values) land in their rows (measured: 512 rows 9.6 → 1.9 ms, 2 cores)."""
    prompt_lengths = torch.tensor([len(r.prompt_ids) for r in rows])
    lengths = prompt_lengths + torch.tensor([len(r.response_ids) for r in rows])
    width = int(lengths.max())
    columns = torch.arange(width)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    input_ids[columns < lengths[:, None]] = torch.tensor([t for r in rows for ids in (r.prompt_ids, r.response_ids)
                                                          for t in ids])  # fmt: skip
    labelled = (columns >= prompt_lengths[:, None] - 1) & (columns < lengths[:, None] - 1)
    token_rewarded = torch.tensor([r.token_rewards is not None for r in rows])
    behavior_rows = torch.tensor([r.behavior_log_probs is not None for r in rows])
    batch = Batch(
        input_ids=input_ids,
        labels=torch.roll(input_ids, -1, dims=1),
        loss_mask=labelled.float(),
        position_ids=columns.expand(len(rows), width).clone(),
        lengths=lengths,
        scores=torch.tensor([float("nan") if r.token_rewards is not None else r.reward for r in rows]),
        token_level_scores=_at_labels(labelled, token_rewarded, [r.token_rewards for r in rows]),
        group=_dense_ids([r.uid for r in rows]),
    )
    if behavior_rows.any():
        batch["behavior_log_prob"] = _at_labels(labelled, behavior_rows, [r.behavior_log_probs for r in rows])
        batch["behavior_rows"] = behavior_rows
    routed = [r.routed_experts for r in rows if r.routed_experts is not None]
    if routed:  # R3: every row carries them (data.parse), one entry per input token (or one fewer)
        _, layers, topk = routed[0].shape
        experts = torch.zeros(len(rows), width, layers, topk, dtype=record_dtype(int(max(r.max() for r in routed)) + 1))
        routed_lengths = torch.tensor([0 if r.routed_experts is None else len(r.routed_experts) for r in rows])
        experts[columns < routed_lengths[:, None]] = torch.cat(routed).to(experts.dtype) + 1
        batch["routed_experts"] = experts
    return batch


def _at_labels(labelled: torch.Tensor, carried: torch.Tensor, values: list[list[float] | None]) -> torch.Tensor:
    """[R, W] zeros with each carrying row's per-token `values` (one per response token) at its label positions."""
    out = torch.zeros(labelled.shape)
    if carried.any():
        out[labelled & carried[:, None]] = torch.tensor([v for row in values if row is not None for v in row])
    return out


def build_sampler(config: PPOConfig, rows: Sequence[Row]) -> tuple[EpochSampler | GroupSampler, int, str | None]:
    """The batch order of a run: rows shuffled one by one (GAE), or whole `uid` groups (GRPO, so that every group's
    advantage is relative to all of its responses). Returns (sampler, rows it draws from, a line for the logs).

    GRPO keeps the groups of the most common size and leaves the others out (counted in the line);
    `data.train_batch_size` must be a multiple of that size, and a dataset whose rows are mostly alone in their
    group is refused: their advantage would be the raw score or zero."""
    seed, shuffle = config.data.seed, config.data.shuffle
    estimator = config.algorithm.adv_estimator
    if estimator not in GROUPED_ESTIMATORS:
        return EpochSampler(len(rows), seed=seed, shuffle=shuffle), len(rows), None
    grouping = group_rows(column(rows, "uid"))
    line = grouping.summary(column(rows, "source"))
    if grouping.group_size <= 1 or 2 * grouping.singleton_rows > len(rows):
        raise ConfigError([
            f"algorithm.adv_estimator={estimator}: {line} — it compares the responses to one prompt, so most rows here "
            "have nothing to compare with; give each row its prompt's group as 'uid' (or the same prompt), with "
            "several responses per prompt, or use algorithm.adv_estimator=gae"
        ])  # fmt: skip
    batch = config.data.train_batch_size
    if batch % grouping.group_size:
        low = batch // grouping.group_size * grouping.group_size
        raise ConfigError([
            f"data.train_batch_size={batch}: {estimator} draws whole groups of {grouping.group_size} rows, so it "
            f"must be a multiple of {grouping.group_size}, e.g. {max(low, grouping.group_size)} or "
            f"{low + grouping.group_size} ({line})"
        ])  # fmt: skip
    sampler = GroupSampler(grouping.groups, seed=seed, shuffle=shuffle)
    return sampler, len(grouping.groups) * grouping.group_size, line


def select[AnyBatch: dict](batch: AnyBatch, indices: Sequence[int]) -> AnyBatch:
    """The rows `indices` of `batch`, token tensors trimmed to the longest of those rows."""
    index = torch.as_tensor(list(indices), dtype=torch.long)
    width = int(batch["lengths"][index].max())
    out = {}
    for key, value in batch.items():  # every tensor has the rows first; those of 2 dims or more, tokens second
        rows = value[index]
        out[key] = rows[:, :width] if rows.dim() >= 2 else rows
    return out


def replica_micro_batches[AnyBatch: dict](
    batch: AnyBatch, micro_batch_size: int | None, max_tokens: int | None = None, pack_multiple: int | None = None
) -> tuple[list[int], list[list[int]], list[AnyBatch]]:
    """This data-parallel replica's rows of `batch` cut into micro-batches: fixed-size ones, or token-budget ones
    when `max_tokens` is given, as many on every replica (`collectives.dynamic_micro_batch_count`) — with
    `pack_multiple` (the model packs its sequences, each padded to that multiple: `models.packing`) budgets of
    packed tokens (`packed_micro_batches`), else of rows × the longest row. Returns (the replica's row indices, the
    groups as positions in them, the micro-batches)."""
    share = data_parallel_share(batch["input_ids"].shape[0])
    lengths = batch["lengths"][share].tolist()
    if max_tokens is not None and pack_multiple is not None:
        padded = segment_lengths(lengths, pack_multiple)
        own = len(packed_micro_batches(padded, max_tokens))
        groups = packed_micro_batches(padded, max_tokens, count=dynamic_micro_batch_count(own))
    elif max_tokens is not None:
        own = len(dynamic_micro_batches(lengths, max_tokens))
        groups = dynamic_micro_batches(lengths, max_tokens, count=dynamic_micro_batch_count(own))
    else:
        groups = fixed_micro_batches(lengths, micro_batch_size)
    return share, groups, [select(batch, [share[i] for i in group]) for group in groups]


def _dense_ids(labels: Sequence[str]) -> torch.Tensor:
    """Group labels (uids) → ids 0..G−1 in order of first appearance (GRPO groups)."""
    dense: dict[str, int] = {}
    return torch.tensor([dense.setdefault(label, len(dense)) for label in labels], dtype=torch.long)
