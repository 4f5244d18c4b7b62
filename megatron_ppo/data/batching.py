"""Split a batch into micro-batches, and draw batches (of rows, or of whole GRPO groups) epoch by epoch. Pure Python
and torch, no Megatron.

A micro-batch is a list of row indices; it is padded to its longest row, so its cost is
    padded size = len(micro-batch) × max length in it,
and the padding fraction of a split is 1 − Σ lengths / Σ padded sizes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def fixed_micro_batches(lengths: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` indices into `lengths`, in order; the last may be shorter."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be ≥ 1, got {micro_batch_size}")
    n = len(lengths)
    return [list(range(start, min(start + micro_batch_size, n))) for start in range(0, n, micro_batch_size)]


def dynamic_micro_batches(lengths: Sequence[int], max_tokens: int, count: int | None = None) -> list[list[int]]:
    """Token-budget micro-batches: every micro-batch's padded size is ≤ `max_tokens`.

    Next-fit decreasing: indices sorted by length, longest first (ties by index), are taken in turn into the open
    micro-batch while (rows + 1) × its first (longest) length fits, else a new one is opened. Rows of similar length
    so share a micro-batch, which keeps padding low on skewed length distributions. Deterministic; every index
    appears exactly once; micro-batches come longest first, each in that sorted order.

    With `count` (at least the packing's own number): exactly `count` micro-batches, made by halving the one of
    largest padded size (of those with two rows or more; the first on a tie) until there are that many — each half
    stays within the budget. Pipeline schedules and expert all-to-alls need a given count (`train/batch.py`).
    """
    micro_batches = _packed(lengths, max_tokens)
    if count is None:
        return micro_batches
    return _halved_to(micro_batches, count, len(lengths), max_tokens, "micro-batches",
                      size=lambda mb: len(mb) * lengths[mb[0]])  # fmt: skip


def _halved_to(micro_batches: list[list[int]], count: int, rows: int, max_tokens: int, kind: str,
               size: Callable[[list[int]], int]) -> list[list[int]]:  # fmt: skip
    """`micro_batches` cut into exactly `count`, by halving the one of largest `size` (of those with two rows or
    more; the first on a tie) until there are that many: each half stays within the budget the whole kept."""
    if not len(micro_batches) <= count <= rows:
        raise ValueError(
            f"cannot cut {rows} rows into {count} {kind} within max_tokens={max_tokens} (the budget packs them into "
            f"{len(micro_batches)}); the count is the largest on any data-parallel rank, a multiple of PP with "
            "virtual stages: give each rank more rows (ppo_mini_batch_size) or use fewer pipeline stages"
        )
    while len(micro_batches) < count:
        sizes = [size(mb) if len(mb) > 1 else -1 for mb in micro_batches]
        widest = sizes.index(max(sizes))
        half = len(micro_batches[widest]) // 2
        micro_batches[widest : widest + 1] = [micro_batches[widest][:half], micro_batches[widest][half:]]
    return micro_batches


def _packed(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """The next-fit decreasing packing of `dynamic_micro_batches`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be ≥ 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    micro_batches: list[list[int]] = []
    for i in order:
        if lengths[i] > max_tokens:
            raise ValueError(
                f"sequence {i} has {lengths[i]} tokens, more than the micro-batch budget max_tokens={max_tokens}: "
                "raise the budget (ppo_max_token_len_per_gpu) or lower data.max_prompt_length/max_response_length"
            )
        if micro_batches and (len(micro_batches[-1]) + 1) * lengths[micro_batches[-1][0]] <= max_tokens:
            micro_batches[-1].append(i)
        else:
            micro_batches.append([i])
    return micro_batches


def packed_micro_batches(lengths: Sequence[int], max_tokens: int, count: int | None = None) -> list[list[int]]:
    """Token-budget micro-batches for packed sequences (`models.packing`): Σ lengths of every micro-batch ≤
    `max_tokens` — a pack computes its tokens, not rows × its longest row (pass each sequence's length padded to
    the layout's multiple). First-fit decreasing: indices sorted by length, longest first (ties by index), each into
    the first micro-batch it fits. Deterministic; every index exactly once; a sequence is never split.

    With `count` (at least the packing's own number): exactly `count` micro-batches, made by halving the one of
    most tokens (of those with two rows or more; the first on a tie) until there are that many."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be ≥ 1, got {max_tokens}")
    micro_batches: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_tokens:
            raise ValueError(
                f"sequence {i} has {lengths[i]} tokens, more than the micro-batch budget max_tokens={max_tokens}: "
                "raise the budget (ppo_max_token_len_per_gpu) or lower data.max_prompt_length/max_response_length"
            )
        fits = next((k for k, load in enumerate(loads) if load + lengths[i] <= max_tokens), None)
        if fits is None:
            micro_batches.append([i])
            loads.append(lengths[i])
        else:
            micro_batches[fits].append(i)
            loads[fits] += lengths[i]
    if count is None:
        return micro_batches
    return _halved_to(micro_batches, count, len(lengths), max_tokens, "packed micro-batches",
                      size=lambda mb: sum(lengths[i] for i in mb))  # fmt: skip


def padding_fraction(lengths: Sequence[int], micro_batches: Sequence[Sequence[int]]) -> float:
    """1 − Σ lengths / Σ_mb (len(mb) × max length in mb): the share of padded positions that are padding."""
    real = sum(lengths[i] for mb in micro_batches for i in mb)
    padded = sum(len(mb) * max(lengths[i] for i in mb) for mb in micro_batches if mb)
    return 1.0 - real / padded if padded else 0.0


class EpochSampler:
    """Batches of row indices, epoch after epoch, reproducible from (seed, epoch, position).

    Epoch e visits range(num_rows) in a fixed permutation, or in order when `shuffle` is False. The permutation is
    `torch.randperm` under a generator seeded with a 32-bit hash of (seed, e): torch's CPU generator keeps only 32
    bits of a seed, and unlike seed + e the hash does not make seed s+1 replay seed s one epoch behind.

    A batch never straddles epochs: when fewer than `batch_size` rows are left in the current epoch, they are
    dropped — added to `dropped_last` — and the batch is drawn from the start of the next epoch.

    `epoch` and `position` say where the next batch starts (the epoch advances lazily, when a batch cannot be
    served from it); `state_dict()` / `load_state_dict()` carry them, so a resumed run draws the same indices as an
    uninterrupted one.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool = True) -> None:
        if num_rows < 1:
            raise ValueError(f"num_rows must be ≥ 1, got {num_rows}")
        self.num_rows, self.seed, self.shuffle = num_rows, seed, shuffle
        self.epoch = 0
        self.position = 0
        self.dropped_last = 0  # rows left out at the ends of epochs, in total
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        digest = hashlib.blake2b(f"{self.seed}:{epoch}".encode(), digest_size=4).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little"))
        return torch.randperm(self.num_rows, generator=generator).tolist()

    def next_batch(self, batch_size: int) -> list[int]:
        """The next `batch_size` indices, all from one epoch."""
        if not 1 <= batch_size <= self.num_rows:
            raise ValueError(f"batch_size must be in [1, num_rows={self.num_rows}], got {batch_size}")
        if self.position + batch_size > self.num_rows:
            self.dropped_last += self.num_rows - self.position
            self.epoch += 1
            self.position = 0
            self._order = self._permutation(self.epoch)
        batch = self._order[self.position : self.position + batch_size]
        self.position += batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_rows": self.num_rows,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "epoch": self.epoch,
            "position": self.position,
            "dropped_last": self.dropped_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state`; the dataset size, seed and shuffle must be those it was saved with."""
        for key in ("num_rows", "seed", "shuffle"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                    "resuming would draw different rows"
                )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self.dropped_last = int(state["dropped_last"])
        self._order = self._permutation(self.epoch)


class GroupSampler:
    """Batches of whole groups (GRPO: the rows sharing a `uid`), epoch after epoch, reproducible like
    `EpochSampler`, whose permutation it applies to the groups.

    Every group has `group_size` rows and a batch holds `batch_size / group_size` of them, so no group is ever split
    across batches. Groups left at the end of an epoch that cannot fill a batch are dropped (their rows counted in
    `dropped_last`) and the batch is drawn from the next epoch.
    """

    def __init__(self, groups: Sequence[Sequence[int]], seed: int, shuffle: bool = True) -> None:
        sizes = {len(group) for group in groups}
        if len(sizes) != 1:
            raise ValueError(f"groups must all have one size, got sizes {sorted(sizes)}")
        self.groups = [list(group) for group in groups]
        self.group_size = sizes.pop()
        self.groups_sampler = EpochSampler(len(self.groups), seed=seed, shuffle=shuffle)

    def next_batch(self, batch_size: int) -> list[int]:
        """The rows of the next `batch_size / group_size` groups, all from one epoch, group by group."""
        if batch_size % self.group_size:
            raise ValueError(f"batch_size {batch_size} is not a multiple of the group size {self.group_size}")
        picked = self.groups_sampler.next_batch(batch_size // self.group_size)
        return [row for group in picked for row in self.groups[group]]

    @property
    def epoch(self) -> int:
        return self.groups_sampler.epoch

    @property
    def dropped_last(self) -> int:
        return self.groups_sampler.dropped_last * self.group_size

    def state_dict(self) -> dict[str, Any]:
        return {**self.groups_sampler.state_dict(), "group_size": self.group_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("group_size") != self.group_size:
            raise ValueError(
                f"sampler state has group_size={state.get('group_size')!r} but the data has {self.group_size}; "
                "resuming would draw different groups"
            )
        self.groups_sampler.load_state_dict({k: v for k, v in state.items() if k != "group_size"})


@dataclass(frozen=True)
class Grouping:
    """The GRPO groups of a dataset: the groups of the common size, and what is left out."""

    groups: list[list[int]]  # row indices of each kept group, in first-appearance order
    group_size: int  # the most common group size
    left_out: list[list[int]]  # groups of another size: not sampled
    singleton_rows: int  # rows alone in their group, among all rows

    def summary(self, sources: Sequence[str]) -> str:
        text = f"grpo: {len(self.groups)} groups of {self.group_size} rows"
        if self.left_out:
            rows = sum(len(g) for g in self.left_out)
            text += (f"; {len(self.left_out)} groups of another size ({rows} rows) left out, e.g. the group of "
                     f"{sources[self.left_out[0][0]]} ({len(self.left_out[0])} rows)")  # fmt: skip
        return text + f"; {self.singleton_rows} rows alone in their group"


def group_rows(uids: Sequence[str]) -> Grouping:
    """Rows grouped by `uid`; the groups of the most common size (the larger one on a tie) are kept."""
    by_uid: dict[str, list[int]] = {}
    for index, uid in enumerate(uids):
        by_uid.setdefault(uid, []).append(index)
    groups = list(by_uid.values())
    counts: dict[int, int] = {}
    for group in groups:
        counts[len(group)] = counts.get(len(group), 0) + 1
    size = max(counts, key=lambda s: (counts[s], s)) if counts else 0
    return Grouping(
        groups=[g for g in groups if len(g) == size],
        group_size=size,
        left_out=[g for g in groups if len(g) != size],
        singleton_rows=sum(1 for g in groups if len(g) == 1),
    )
