"""Reward shaping: clipping, running normalisation, and token-level rewards with a KL penalty."""

from __future__ import annotations

import math

import torch


def clip_rewards(scores: torch.Tensor, clip_range: tuple[float, float] | None) -> torch.Tensor:
    """clamp(scores, low, high); `None` leaves them as they are."""
    if clip_range is None:
        return scores
    low, high = clip_range
    return scores.clamp(min=low, max=high)


class RunningRewardNormalizer:
    """Normalises sequence scores by running statistics: (s − μ) / √(σ² + ε), μ and σ² over all scores seen.

    The statistics are merged batch by batch with Chan et al.'s parallel update, so the result equals the mean and
    (population) variance of the concatenation of every batch seen, in float64.
    """

    def __init__(self, epsilon: float = 1e-8) -> None:
        self.epsilon = epsilon
        self.count = 0
        self.mean = 0.0
        self.m2 = 0.0  # Σ (x − μ)²

    @property
    def var(self) -> float:
        return self.m2 / self.count if self.count else 1.0

    def update(self, scores: torch.Tensor) -> None:
        batch = scores.detach().double().flatten()
        n = batch.numel()
        if n == 0:
            return
        batch_mean = batch.mean().item()
        batch_m2 = (batch - batch_mean).square().sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        return (scores - self.mean) / math.sqrt(self.var + self.epsilon)

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2, "epsilon": self.epsilon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
        self.epsilon = float(state["epsilon"])


def scores_to_token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score on the last response token: `[batch]`, `[batch, response_len]` → `[batch, T]`.

    A row with no response token has nowhere to put its reward: that is an error, never a silent drop.
    """
    lengths = response_mask.sum(dim=-1)
    if (lengths == 0).any():
        empty = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"rows {empty} have an empty response mask; their reward would be lost")
    # index of the last unmasked token (the mask need not be left-aligned)
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    last = torch.where(response_mask.bool(), positions, -1).amax(dim=-1)
    token_scores = torch.zeros(response_mask.shape, dtype=scores.dtype, device=scores.device)
    token_scores[torch.arange(scores.shape[0], device=scores.device), last] = scores
    return token_scores


def kl_penalized_rewards(
    token_level_scores: torch.Tensor, kl: torch.Tensor, kl_coef: float, response_mask: torch.Tensor
) -> torch.Tensor:
    """r_t = score_t − β · KL_t on response tokens (verl's `apply_kl_penalty`); KL_t is a per-token estimate."""
    return token_level_scores - kl_coef * kl * response_mask
