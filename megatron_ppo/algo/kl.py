"""KL divergence between the policy and the frozen reference.

Per-token estimators of KL(π‖π_ref) from sampled-token log-probs, after J. Schulman, "Approximating KL
divergence" (2020), with r = π_ref/π = exp(ref_log_prob − log_prob):

    k1 ("kl")          log π − log π_ref                 unbiased, high variance, can be negative
    abs                |log π − log π_ref|
    k2 ("mse")         ½ (log π − log π_ref)²            biased, but its gradient is the KL gradient
    k3 ("low_var_kl")  r − log r − 1                     unbiased, low variance, ≥ 0

A trailing "+" (e.g. "k3+") keeps the value of the estimator but takes the gradient of k2 (straight-through),
the unbiased KL-gradient estimator. Names and clamps are those of verl's `kl_penalty`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from megatron_ppo.algo.registry import registrar

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {}  # verl's names (and aliases) → estimator
_LOG_RATIO_CLAMP = 20.0  # exp(±20) keeps float32 finite
_K3_CLAMP = 10.0


# Decorator: the function becomes `KL_ESTIMATORS[name]` (a new entry is one decorated function).
register_kl = registrar(KL_ESTIMATORS, "KL estimator")


@register_kl("k1", "kl")
def k1_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """log π − log π_ref."""
    return log_prob - ref_log_prob


@register_kl("abs")
def abs_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """|log π − log π_ref|."""
    return (log_prob - ref_log_prob).abs()


@register_kl("k2", "mse")
def k2_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """½ (log π − log π_ref)²."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl("k3", "low_var_kl")
def k3_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """clamp(r − log r − 1, ±10) with log r = clamp(log π_ref − log π, ±20)."""
    log_r = torch.clamp(ref_log_prob - log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
    return torch.clamp(torch.exp(log_r) - log_r - 1, min=-_K3_CLAMP, max=_K3_CLAMP)


# What a config may name: every estimator, and each with a trailing "+" (its straight-through k2 gradient)
KL_PENALTY_CHOICES = (*KL_ESTIMATORS, *(kind + "+" for kind in KL_ESTIMATORS))


def _kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    if kind not in KL_ESTIMATORS:
        valid = ", ".join(KL_ESTIMATORS) + " (each also with a trailing '+')"
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {valid}")
    return KL_ESTIMATORS[kind](log_prob, ref_log_prob)


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimate of the given `kind`, shape of `log_prob` (`[batch, response_len]`).

    With a trailing "+", value = estimator(kind) and gradient = ∇ ½(log π − log π_ref)² (straight-through).
    """
    straight_through = kind.endswith("+")
    base_kind = kind[:-1] if straight_through else kind
    estimate = _kl_estimate(log_prob, ref_log_prob, base_kind)
    if not straight_through or KL_ESTIMATORS.get(base_kind) is k2_estimate:
        return estimate
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    return k2 - k2.detach() + estimate.detach()


def kl_from_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """Exact KL(p‖q) = Σ_v p_v (log p_v − log q_v) over the vocabulary, p = softmax(logits), q = softmax(ref_logits).

    Shapes: `[..., vocab]` → `[...]`. Computed in float32 for stability.
    """
    log_p = F.log_softmax(logits.float(), dim=-1)
    log_q = F.log_softmax(ref_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)
