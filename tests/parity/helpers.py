"""Parity tests against verl 0.9.1: every comparison records its largest absolute difference for the summary."""

from __future__ import annotations

import torch

LARGEST_DIFFERENCE: dict[str, float] = {}


def assert_matches_verl(name: str, ours: torch.Tensor | float, theirs: torch.Tensor | float, tol: float = 1e-6) -> None:
    """|ours − theirs| ≤ tol·max(1, |theirs|) elementwise (float32), recording the largest difference seen."""
    ours_t, theirs_t = _float64(ours), _float64(theirs)
    assert ours_t.shape == theirs_t.shape, f"{name}: shape {tuple(ours_t.shape)} vs verl {tuple(theirs_t.shape)}"
    both_nan = torch.isnan(ours_t) & torch.isnan(theirs_t)
    diff = torch.where(both_nan, 0.0, (ours_t - theirs_t).abs())
    largest = float(diff.max()) if diff.numel() else 0.0
    LARGEST_DIFFERENCE[name] = max(LARGEST_DIFFERENCE.get(name, 0.0), largest)
    allowed = tol * theirs_t.abs().clamp(min=1.0)
    worst = int(torch.argmax(diff - allowed)) if diff.numel() else 0
    assert bool((diff <= allowed).all()), (
        f"{name}: differs from verl by {largest:.3e} (at flat index {worst}: ours "
        f"{ours_t.flatten()[worst].item():.9g}, verl {theirs_t.flatten()[worst].item():.9g})"
    )


def _float64(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.as_tensor(value, dtype=torch.float64)


def make_batch(batch: int, length: int, seed: int) -> dict[str, torch.Tensor]:
    """Random PPO tensors `[batch, length]`: row 0 has an empty response, row 1 a one-token response, and some
    log-ratios lie beyond ±20 so the clamps are exercised."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=gen)
    lengths[0], lengths[1] = 0, 1
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    log_prob = -torch.rand(batch, length, generator=gen) * 5
    old_log_prob = log_prob + torch.randn(batch, length, generator=gen) * 0.3
    ref_log_prob = log_prob + torch.randn(batch, length, generator=gen) * 0.5
    extreme = torch.rand(batch, length, generator=gen) < 0.05
    old_log_prob = torch.where(
        extreme, log_prob + 30 * torch.sign(torch.randn(batch, length, generator=gen)), old_log_prob
    )
    ref_log_prob = torch.where(extreme, log_prob - 25, ref_log_prob)
    return {
        "mask": mask,
        "log_prob": log_prob,
        "old_log_prob": old_log_prob,
        "ref_log_prob": ref_log_prob,
        "advantages": torch.randn(batch, length, generator=gen),
        "values": torch.randn(batch, length, generator=gen),
        "returns": torch.randn(batch, length, generator=gen),
        "rewards": torch.randn(batch, length, generator=gen),
    }


SHAPES = [(4, 1), (6, 7), (16, 33), (32, 128)]
