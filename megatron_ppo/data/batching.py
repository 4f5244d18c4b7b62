"""Split a batch into micro-batches, and draw batches epoch by epoch. Pure Python and torch, no Megatron.

A micro-batch is a list of row indices; it is padded to its longest row, so its cost is
    padded size = len(micro-batch) × max length in it,
and the padding fraction of a split is 1 − Σ lengths / Σ padded sizes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch


def fixed_micro_batches(lengths: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive groups of `micro_batch_size` indices into `lengths`, in order; the last may be shorter."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be ≥ 1, got {micro_batch_size}")
    n = len(lengths)
    return [list(range(start, min(start + micro_batch_size, n))) for start in range(0, n, micro_batch_size)]


def dynamic_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Token-budget micro-batches: every micro-batch's padded size is ≤ `max_tokens`.

    Next-fit decreasing: indices sorted by length, longest first (ties by index), are taken in turn into the open
    micro-batch while (rows + 1) × its first (longest) length fits, else a new one is opened. Rows of similar length
    so share a micro-batch, which keeps padding low on skewed length distributions. Deterministic; every index
    appears exactly once; micro-batches come longest first, each in that sorted order.
    """
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
