"""Masked reductions over response tokens. Shapes: values and mask are `[batch, response_len]`."""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask. NaN/inf outside the mask never leak into the sum."""
    weighted = torch.where(mask.bool(), values, 0.0) * mask
    return weighted.sum() if dim is None else weighted.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values·mask / (Σ mask + 1e-8): an empty mask gives 0, not NaN."""
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    return masked_sum(values, mask, dim) / (count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Var over masked elements; with `unbiased`, times n/(n−1) (Bessel). Needs at least two elements."""
    centered = values - masked_mean(values, mask)
    variance = masked_mean(centered.square(), mask)
    if unbiased:
        count = mask.sum()
        if count < 2:
            raise ValueError(f"masked_var needs at least 2 unmasked elements for the unbiased estimate, got {count}")
        variance = variance * count / (count - 1)
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x − μ)/√(σ² + 1e-8) with μ, σ² over the masked elements; `shift_mean=False` adds μ back."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean
