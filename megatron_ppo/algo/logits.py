"""Quantities of a categorical distribution given by logits (`[..., vocab]`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H(p) = logsumexp(z) − Σ_v softmax(z)_v · z_v, shape `[...]` (the stable form verl uses)."""
    probs = F.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)
