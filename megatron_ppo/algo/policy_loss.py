"""Policy losses for the actor, registered by verl's names (`actor.policy_loss.loss_mode`).

Every entry has verl 0.9.1's signature and argument order,

    fn(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        → (loss, metrics)

with token tensors `[batch, response_len]`, `config` a `PolicyLossConfig` (verl reads the same leaves off its
`ActorConfig`) and `rollout_is_weights` the detached off-policy correction weights (`rollout_correction`) that
multiply each token's loss. Metrics are detached scalar tensors named as verl's without the `actor/` prefix
(`pg_clipfrac`, `pg_clipfrac_lower`, `ppo_kl`): each is a token mean over this micro-batch. Aggregation over the
mini-batch follows `agg_loss`'s contract with `config.global_batch_info` (dp_size, batch_num_tokens,
global_batch_size, loss_scale_factor).

Sequence-level quantities (GSPO's and GMPO's sequence ratios) are computed per row, so they are exact whenever each
row is whole in one micro-batch on one rank — true for every layout but context parallelism, which validation
refuses for these modes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from megatron_ppo.algo.aggregation import agg_loss
from megatron_ppo.algo.masked import masked_mean
from megatron_ppo.algo.registry import registrar

_LOG_RATIO_CLAMP = 20.0
_GSPO_LOG_RATIO_MAX = 10.0

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
POLICY_LOSSES: dict[str, PolicyLossFn] = {}
# Losses over whole rows (`sequence_level=True` where registered): each row's tokens must sit on one rank (no
# context parallelism).
SEQUENCE_LEVEL_LOSSES: set[str] = set()


@dataclass(frozen=True)
class PolicyLossConfig:
    """The actor settings a policy loss reads — verl's `ActorConfig` leaves (`clip_ratio*`, `tau_*`) and its
    `policy_loss.*` leaves — plus the mini-batch counts of `agg_loss` (`global_batch_info`)."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None: clip_ratio
    clip_ratio_high: float | None = None  # None: clip_ratio
    clip_ratio_c: float = 3.0  # dual clip (vanilla), truncation of the ratio (dppo_*)
    tau_pos: float = 1.0  # SAPO gate temperature where A > 0
    tau_neg: float = 1.05  # SAPO gate temperature where A ≤ 0
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    dro_beta: float | None = None
    global_batch_info: dict[str, float] = field(default_factory=dict)

    @property
    def low(self) -> float:
        return self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low

    @property
    def high(self) -> float:
        return self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high


# Decorator: the function becomes `POLICY_LOSSES[name]` (a new entry is one decorated function).
register_policy_loss = registrar(POLICY_LOSSES, "policy loss", {"sequence_level": SEQUENCE_LEVEL_LOSSES})


def get_policy_loss_fn(name: str) -> PolicyLossFn:
    """The registered loss `name`; an unknown name raises with the registered ones."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; expected one of {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def _aggregate(
    pg_losses: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None,
) -> torch.Tensor:
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    return agg_loss(pg_losses, response_mask, loss_agg_mode, **config.global_batch_info)


def _clamped_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    return torch.clamp(log_prob - old_log_prob, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip with asymmetric and dual clipping (Schulman et al. 2017; Ye et al. 2019):

        ρ      = exp(clamp(log π − log π_old, ±20))
        ℓ_clip = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high))
        ℓ      = min(ℓ_clip, −A·c) where A < 0 (c = clip_ratio_c > 1), ℓ_clip where A ≥ 0

    `pg_clipfrac`: share of tokens on the clipped branch; `pg_clipfrac_lower`: share capped by the dual clip.
    """
    config = config or PolicyLossConfig()
    if config.clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO, got {config.clip_ratio_c}")
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    clip_loss = torch.maximum(unclipped, clipped)
    dual_cap = -advantages * config.clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clip_loss, dual_cap), clip_loss)
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": masked_mean(((clip_loss > dual_cap) & negative).float(), response_mask),
        }
    return loss, metrics


def _dppo(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config: PolicyLossConfig,
    rollout_is_weights: torch.Tensor | None,
    divergence: str,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    truncated_ratio = torch.clamp(ratio, max=config.clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    if divergence == "tv":
        valid_positive = (prob - old_prob) <= config.high
        valid_negative = (prob - old_prob) >= -config.low
    else:
        binary_kl = old_prob * (old_log_prob - log_prob) + (1 - old_prob) * torch.log(
            (1.0 - old_prob + 1e-8) / (1.0 - prob + 1e-8)
        )
        valid_positive = (binary_kl <= config.high) | (prob <= old_prob)
        valid_negative = (binary_kl <= config.low) | (prob >= old_prob)
    valid = torch.where(advantages > 0, valid_positive, valid_negative).detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean(1.0 - valid, response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": masked_mean((ratio > config.clip_ratio_c).float() * valid, response_mask),
        }
    return loss, metrics


@register_policy_loss("dppo_tv")
def dppo_tv_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-TV (arXiv 2602.04879): a token trains only inside a total-variation trust region,

        valid = (π − π_old ≤ ε_high) where A > 0,   (π − π_old ≥ −ε_low) where A ≤ 0
        ℓ     = −A · sg(min(ρ, c)) · log π · valid          (c = clip_ratio_c truncates the ratio)

    `pg_clipfrac`: share outside the region; `pg_clipfrac_lower`: share inside it whose ratio was truncated.
    """
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                 config or PolicyLossConfig(), rollout_is_weights, "tv")  # fmt: skip


@register_policy_loss("dppo_kl")
def dppo_kl_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-Binary-KL (arXiv 2602.04879): as `dppo_tv`, with the region a binary KL between old and new
    probability of the sampled token,

        D     = p_old·log(p_old/p) + (1 − p_old)·log((1 − p_old + 1e-8)/(1 − p + 1e-8))
        valid = (D ≤ ε_high or p ≤ p_old) where A > 0,   (D ≤ ε_low or p ≥ p_old) where A ≤ 0
    """
    return _dppo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                 config or PolicyLossConfig(), rollout_is_weights, "kl")  # fmt: skip


@register_policy_loss("gspo", sequence_level=True)
def gspo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): one length-normalised ratio per sequence,

        log s_i   = Σ_t m_t (log π − log π_old) / max(Σ_t m_t, 1)
        log s_i,t = min(sg(log s_i) + log π − sg(log π), 10)      (value s_i, gradient of the token)
        ℓ         = max(−A·s_i,t, −A·clip(s_i,t, 1 − ε_low, 1 + ε_high))

    `ppo_kl` is the token mean of log π_old − log π; `pg_clipfrac_lower` is 0.
    """
    config = config or PolicyLossConfig()
    log_ratio = log_prob - old_log_prob
    seq_lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = (log_ratio * response_mask).sum(dim=-1) / seq_lengths
    log_seq_ratio = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    seq_ratio = torch.exp(torch.clamp(log_seq_ratio, max=_GSPO_LOG_RATIO_MAX))
    unclipped = -advantages * seq_ratio
    clipped = -advantages * torch.clamp(seq_ratio, 1 - config.low, 1 + config.high)
    pg_losses = torch.maximum(unclipped, clipped)
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": torch.zeros((), device=loss.device),
        }
    return loss, metrics


@register_policy_loss("sapo")
def sapo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO (arXiv 2511.20347): a smooth sigmoid gate instead of a hard clip,

        ρ = exp(clamp(log π − log π_old, ±20)),   τ = τ_pos where A > 0 else τ_neg
        ℓ = −A · σ(τ(ρ − 1)) · 4/τ

    always aggregated `seq-mean-token-mean` (as verl: `loss_agg_mode` is not read). `pg_clipfrac*` are 0.
    """
    config = config or PolicyLossConfig()
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    tau_pos = torch.as_tensor(config.tau_pos, dtype=advantages.dtype, device=advantages.device)
    tau_neg = torch.as_tensor(config.tau_neg, dtype=advantages.dtype, device=advantages.device)
    taus = torch.where(advantages > 0, tau_pos, tau_neg)
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    pg_losses = -gates * advantages
    loss = _aggregate(pg_losses, response_mask, "seq-mean-token-mean", config, rollout_is_weights)
    zero = torch.zeros((), device=loss.device)
    with torch.no_grad():
        metrics = {"pg_clipfrac": zero, "ppo_kl": masked_mean(-log_ratio, response_mask), "pg_clipfrac_lower": zero}
    return loss, metrics


@register_policy_loss("gpg")
def gpg_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG (arXiv 2504.02546), plain policy gradient without a ratio: ℓ = −A · log π. No metrics."""
    config = config or PolicyLossConfig()
    return _aggregate(-log_prob * advantages, response_mask, loss_agg_mode, config, rollout_is_weights), {}


@register_policy_loss("clip_cov")
def clip_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov (Cui et al. 2025, arXiv 2505.22617): PPO-clip without dual clip, whose gradient is cut for a random
    `clip_cov_ratio` share of tokens (at least one) among the unclipped ones with centred covariance

        cov_t = (A_t − mean A)·(log π_t − mean log π)   in (clip_cov_lb, clip_cov_ub)
        ℓ     = max(−A·ρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)) · (0 on the chosen tokens, else 1)

    ρ is not clamped (as verl). The choice draws from torch's global generator (`torch.randperm`), as verl's does.
    `pg_clipfrac`: share of tokens cut.
    """
    config = config or PolicyLossConfig()
    if config.clip_cov_ratio <= 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {config.clip_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - config.low, 1 + config.high)
    clip_by_origin = (clipped > unclipped) & (response_mask > 0)
    cov = (advantages - masked_mean(advantages, response_mask)) * (
        log_prob - masked_mean(log_prob.detach(), response_mask)
    )
    cov = cov.masked_fill((response_mask == 0) | clip_by_origin, -torch.inf)
    clip_num = max(int(config.clip_cov_ratio * response_mask.sum().item()), 1)
    candidates = torch.nonzero((cov < config.clip_cov_ub) & (cov > config.clip_cov_lb) & (response_mask > 0))
    if len(candidates) > 0:
        candidates = candidates[torch.randperm(len(candidates))[: min(clip_num, len(candidates))]]
    corr = torch.ones_like(advantages)
    corr[candidates[:, 0], candidates[:, 1]] = 0
    pg_losses = torch.maximum(unclipped, clipped) * corr
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    with torch.no_grad():
        metrics = {"pg_clipfrac": masked_mean((corr == 0).float(), response_mask),
                   "ppo_kl": masked_mean(-log_ratio, response_mask)}  # fmt: skip
    return loss, metrics


@register_policy_loss("kl_cov")
def kl_cov_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov (Cui et al. 2025): the plain surrogate −A·ρ, plus a |log ρ| penalty on the `kl_cov_ratio` share of
    response tokens (at least one) with the largest covariance (A_t − mean A)·(log π_t − mean log π):

        ℓ = −A·ρ + ppo_kl_coef·|log π − log π_old|   on those tokens,   −A·ρ elsewhere

    ρ is not clamped (as verl). `ppo_kl` is the token mean of |log π − log π_old|.
    """
    config = config or PolicyLossConfig()
    if config.kl_cov_ratio <= 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {config.kl_cov_ratio}")
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    valid = response_mask > 0
    valid_index = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    valid_adv = advantages[valid].detach().reshape(-1).cpu()
    valid_logp = log_prob[valid].detach().reshape(-1).cpu()
    if len(valid_adv) > 0:
        cov = (valid_adv - valid_adv.mean()) * (valid_logp - valid_logp.mean())
        top = valid_index[torch.topk(cov, max(1, int(len(cov) * config.kl_cov_ratio)), largest=True).indices]
        rows, cols = top // advantages.shape[1], top % advantages.shape[1]
        pg_losses = pg_losses.index_put(
            (rows, cols), pg_losses[rows, cols] + config.ppo_kl_coef * log_ratio.abs()[rows, cols]
        )
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(log_ratio.abs(), response_mask)}
    return loss, metrics


@register_policy_loss("geo_mean", sequence_level=True)
def geo_mean_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO (arXiv 2507.20673): the geometric mean of token ratios clipped in log space, per sequence,

        l_t  = sign(A)·min(sign(A)·log ρ_t, sign(A)·clamp(log ρ_t, −ε_low, ε_high))      (log ρ not clamped)
        ℓ_i  = −Ā_i · exp(Σ_t m_t l_t / (Σ_t m_t + 1e-8)),   Ā_i the row's mean advantage
        ℓ_i ← ℓ_i · exp(Σ_t m_t log(w_t + 1e-10) / (Σ_t m_t + 1e-8))   with correction weights w

    The loss is the mean of ℓ_i over the rows (verl's `torch.mean`; `loss_agg_mode` is not read); given
    `global_batch_info`, Σ_i ℓ_i / global_batch_size × dp_size, so that micro-batches sum to the mini-batch mean.
    """
    config = config or PolicyLossConfig()
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    log_ratio_clamped = torch.clamp(log_ratio, -config.low, config.high)
    log_ratio_min = sign * torch.minimum(sign * log_ratio, sign * log_ratio_clamped)
    lengths = response_mask.sum(dim=-1)
    ratio = torch.exp((log_ratio_min * response_mask).sum(dim=-1) / (lengths + 1e-8))
    seq_advantage = (advantages * response_mask).sum(dim=-1) / (lengths + 1e-8)
    pg_losses = -seq_advantage * ratio
    if rollout_is_weights is not None:
        pg_losses = pg_losses * torch.exp(
            (torch.log(rollout_is_weights + 1e-10) * response_mask).sum(dim=-1) / (lengths + 1e-8)
        )
    info = config.global_batch_info
    if info.get("global_batch_size") is None:
        loss = torch.mean(pg_losses)
    else:
        loss = pg_losses.sum() / info["global_batch_size"] * info.get("dp_size", 1)
    clipped = torch.ne(log_ratio, log_ratio_clamped)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped & (advantages > 0)).float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": masked_mean((clipped & (advantages < 0)).float(), response_mask),
        }
    return loss, metrics


@register_policy_loss("dro")
def dro_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct reward optimisation with a quadratic log-ratio penalty (β = dro_beta > 0):

    ℓ = −(A·log π − ½β·(log π − log π_old)²)
    """
    config = config or PolicyLossConfig()
    if config.dro_beta is None or config.dro_beta <= 0:
        raise ValueError(f"policy_loss.dro_beta must be > 0 for loss_mode=dro, got {config.dro_beta}")
    log_ratio = log_prob - old_log_prob
    pg_losses = -(log_prob * advantages - 0.5 * config.dro_beta * log_ratio.square())
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    with torch.no_grad():
        metrics = {"ppo_kl": masked_mean(-log_ratio, response_mask)}
    return loss, metrics


@register_policy_loss("cispo")
def cispo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: PolicyLossConfig | None = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): the clipped ratio as a stop-gradient weight on log π,

        ρ = exp(clamp(log π − log π_old, ±20)),   ℓ = −sg(clip(ρ, 1 − ε_low, 1 + ε_high)) · A · log π

    so every token keeps a gradient. `pg_clipfrac`: share of tokens whose ratio was clipped; `pg_clipfrac_lower` 0.
    """
    config = config or PolicyLossConfig()
    log_ratio = _clamped_log_ratio(log_prob, old_log_prob)
    ratio = torch.exp(log_ratio)
    clipped_ratio = torch.clamp(ratio, 1 - config.low, 1 + config.high)
    pg_losses = -clipped_ratio.detach() * advantages * log_prob
    loss = _aggregate(pg_losses, response_mask, loss_agg_mode, config, rollout_is_weights)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((ratio != clipped_ratio).float(), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": torch.zeros((), device=loss.device),
        }
    return loss, metrics
