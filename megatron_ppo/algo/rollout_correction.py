"""Off-policy corrections against the behaviour policy μ that produced the rows (verl's `rollout_corr_helper`).

Offline rows carry μ's log-probs; the actor at the start of an iteration is π_old. With the per-token log ratio
log ρ_t = log π_old − log μ (`[batch, response_len]`), this module gives, as verl 0.9.1 does:

  - importance weights (`rollout_is`): token w_t = ρ_t, or sequence w = Π_t ρ_t broadcast over the row, each from a
    log ratio clamped to ±20, zero off the mask, then truncated at the threshold (TIS: `"2.0"`) or zeroed outside
    [lower, upper] (IcePop: `"0.5_2.0"`), optionally divided by their batch mean (`rollout_is_batch_normalize`);
  - rejection masks (`rollout_rs`, comma-separated, all must pass): a divergence per token (`token_k*`) or per row
    (`seq_sum_k*`, `seq_mean_k*`, `seq_max_k*`) with k1 = −log ρ (kept in [log lower, log upper]),
    k2 = ½(log ρ)², k3 = ρ − 1 − log ρ (kept ≤ upper);
  - diagnostics (`compute_offpolicy_metrics`): KL(μ‖π_old) (k1 and k3), both perplexities and their ratio,
    χ² per token and per sequence; with weights, their mean/std/extremes and effective sample size
    ESS = 1 / mean_t((w_t / mean w)²); with masks, the rejected shares.

Metric names are verl's (`rollout_corr/<name>` from `compute_rollout_correction_and_rejection_mask`). Everything is
computed once per iteration over the whole batch, so sequence quantities and batch means do not depend on how the
batch is later cut into micro-batches or spread over ranks.
"""

from __future__ import annotations

import math

import torch

from megatron_ppo.algo.masked import masked_mean, masked_sum

SAFETY_BOUND = 20.0
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = (
    "token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
    "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3",
)  # fmt: skip


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """`rollout_is_threshold` → (upper, lower or None): a number is TIS's cap, "lower_upper" IcePop's band."""
    if isinstance(spec, bool) or not isinstance(spec, int | float | str):
        raise ValueError(f"rollout_is_threshold={spec!r}: give a number (TIS cap) or 'lower_upper' (IcePop band)")
    text = str(spec).strip()
    try:
        lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(
            f"rollout_is_threshold={spec!r}: give a number or 'lower_upper', e.g. 2.0 or 0.5_2.0"
        ) from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise ValueError(f"rollout_is_threshold={spec!r}: bounds must be positive with lower ≤ upper")
    return upper, lower


def parse_rs_options(rollout_rs: str) -> list[str]:
    """The distinct options of a comma-separated `rollout_rs`, in order; an unknown one raises with the valid ones."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if not options or unknown:
        raise ValueError(
            f"rollout_rs={rollout_rs!r}: unknown {unknown or 'empty'}; use {', '.join(ROLLOUT_RS_OPTIONS)}"
        )
    return options


def parse_rs_thresholds(options: list[str], spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """Per option (lower or None, upper): one entry for all options or one per option, comma-separated; a k1 option
    takes "lower_upper" (a single number u means [1/u, u]), the others a single upper bound."""
    if spec is None or isinstance(spec, bool):
        raise ValueError("rollout_rs_threshold is required with rollout_rs (e.g. 2.0, or '0.5_2.0' for a *_k1 option)")
    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise ValueError(f"rollout_rs_threshold={spec!r}: give one threshold, or {len(options)} (one per option)")
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts, strict=True):
        try:
            if option.endswith("k1"):
                lower, upper = (float(x) for x in part.split("_", 1)) if "_" in part else (1 / float(part), float(part))
            elif "_" in part:
                raise ValueError
            else:
                lower, upper = None, float(part)
        except (ValueError, ZeroDivisionError):
            form = "'lower_upper' or one number" if option.endswith("k1") else "one positive number"
            raise ValueError(f"rollout_rs_threshold {part!r} for {option}: give {form}") from None
        if upper <= 0 or (lower is not None and not 0 < lower <= upper):
            raise ValueError(f"rollout_rs_threshold {part!r} for {option}: bounds must be positive, lower ≤ upper")
        out[option] = (lower, upper)
    return out


def compute_rollout_correction_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
    rollout_is_batch_normalize: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Detached importance weights `[batch, response_len]` (module docstring) and their metrics (no prefix)."""
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout_is={rollout_is!r}: use one of {', '.join(ROLLOUT_IS_LEVELS)}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    else:
        log_ratio_for_metrics = masked_sum(log_ratio, response_mask, dim=-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(log_ratio_for_metrics, min=-SAFETY_BOUND, max=SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * response_mask
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, log_ratio_for_metrics, response_mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), response_mask).item()
    weights = weights.detach()
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, response_mask)
        else:
            seq_mask = (response_mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (masked_mean(weights, response_mask, dim=-1) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(
    weights: torch.Tensor,
    raw: torch.Tensor,
    log_ratio_for_metrics: torch.Tensor,
    mask: torch.Tensor,
    level: str,
    upper: float,
    lower: float | None,
) -> dict[str, float]:
    """verl's `compute_is_metrics`: extremes, threshold shares, std, ESS, per-sequence summaries."""
    lower = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {"rollout_is_mean": masked_mean(weights, mask).item()}
    if level == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(log_ratio_for_metrics.max(), max=SAFETY_BOUND)).item()
        m["rollout_is_min"] = torch.exp(log_ratio_for_metrics.min()).item()
        log_upper = torch.log(torch.tensor(upper, device=weights.device))
        log_lower = torch.log(torch.tensor(lower, device=weights.device))
        m["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).float(), mask).item()
        m["rollout_is_max"] = weights.masked_fill(~mask.bool(), float("-inf")).max().item()
        m["rollout_is_min"] = weights.masked_fill(~mask.bool(), float("inf")).min().item()
    clamped = weights.clamp(min=0.0, max=upper)
    mean_clamped = masked_mean(clamped, mask)
    if mask.sum() > 1:
        variance = masked_mean(clamped.square(), mask) - mean_clamped.square()
        m["rollout_is_std"] = torch.sqrt(torch.clamp(variance, min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean((clamped / (mean_clamped + 1e-8)).square(), mask).item()
    seq_mean = masked_mean(weights, mask, dim=-1)
    m["rollout_is_seq_mean"] = seq_mean.mean().item()
    m["rollout_is_seq_std"] = seq_mean.std().item() if seq_mean.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = seq_mean.max().item()
    m["rollout_is_seq_min"] = seq_mean.min().item()
    m["rollout_is_seq_max_deviation"] = (seq_mean - 1.0).abs().max().item()
    raw_seq_mean = masked_mean(raw, mask, dim=-1)
    m["rollout_is_seq_fraction_high"] = (raw_seq_mean > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (raw_seq_mean < lower).float().mean().item()
    return m


def _sequence_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    peak = values.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(peak == float("-inf"), torch.zeros_like(peak), peak)


def compute_rollout_rejection_mask(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_rs: str = "token_k1",
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """`response_mask` with the tokens (token_*) or whole rows (seq_*) that fail any option zeroed, and the
    rejection metrics (no prefix): per option its statistic's summary and masked shares, then the combined shares."""
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    options = parse_rs_options(rollout_rs)
    thresholds = parse_rs_thresholds(options, rollout_rs_threshold)
    safe = torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND)
    per_token = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    mask_bool = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        lower, upper = thresholds[option]
        kind = option[-2:]
        k1 = kind == "k1"
        low_log, high = (math.log(lower), math.log(upper)) if k1 else (None, upper)
        token_stat = per_token[kind]
        if option.startswith("token"):
            seq_stat, stat = None, token_stat
        else:
            if option.startswith("seq_sum"):
                seq_stat = masked_sum(token_stat, response_mask, dim=-1)
            elif option.startswith("seq_mean"):
                seq_stat = masked_mean(token_stat, response_mask, dim=-1)
            else:
                seq_stat = _sequence_max(token_stat, response_mask)
            stat = seq_stat.unsqueeze(-1).expand_as(response_mask)
        keep = (stat >= low_log) & (stat <= high) if k1 else stat <= high
        keep_mask = keep.to(log_ratio.dtype)
        combined = combined * keep_mask
        metrics |= _rs_metrics(option, stat, response_mask, seq_valid, seq_stat, high, low_log if k1 else 0.0, k1)
        seq_keep = (~((~keep) & mask_bool)).all(dim=-1)
        valid = seq_valid.float()
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_mask, response_mask).item()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(log_ratio.dtype)) * valid).sum() / valid.sum()).item() if valid.sum() > 0 else 0.0
        )
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    rejected_rows = (~((combined > 0.5) & mask_bool) & mask_bool).any(dim=-1)
    metrics["rollout_rs_seq_masked_fraction"] = rejected_rows.float().mean().item()
    return (response_mask * combined).to(response_mask.dtype), metrics


def _rs_metrics(
    option: str,
    stat: torch.Tensor,
    mask: torch.Tensor,
    seq_valid: torch.Tensor,
    seq_stat: torch.Tensor | None,
    upper: float,
    lower: float,
    use_lower: bool,
) -> dict[str, float]:
    """verl's `compute_rs_metrics` for one option."""
    p = f"rollout_rs_{option}"
    seq_values = (seq_stat if seq_stat is not None else masked_mean(stat, mask, dim=-1))[seq_valid]
    sequence = seq_stat is not None and seq_values.numel() > 0
    m = {f"{p}_mean": masked_mean(stat, mask).item()}
    if sequence:
        m[f"{p}_max"], m[f"{p}_min"] = seq_values.max().item(), seq_values.min().item()
        m[f"{p}_fraction_high"] = (seq_values > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (seq_values < lower).float().mean().item() if use_lower else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~mask.bool(), float("-inf")).max().item()
        m[f"{p}_min"] = stat.masked_fill(~mask.bool(), float("inf")).min().item()
        m[f"{p}_fraction_high"] = masked_mean((stat > upper).float(), mask).item()
        m[f"{p}_fraction_low"] = masked_mean((stat < lower).float(), mask).item() if use_lower else 0.0
    if mask.sum() > 1:
        clamped = stat.clamp(min=lower if use_lower else 0.0, max=upper)
        variance = masked_mean(clamped.square(), mask) - masked_mean(clamped, mask).square()
        m[f"{p}_std"] = torch.sqrt(torch.clamp(variance, min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    if seq_values.numel() > 0:
        m[f"{p}_seq_mean"] = seq_values.mean().item()
        m[f"{p}_seq_std"] = seq_values.std().item() if seq_values.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = seq_values.max().item(), seq_values.min().item()
        m[f"{p}_seq_max_deviation"] = seq_values.abs().max().item()
        m[f"{p}_seq_fraction_high"] = (seq_values > upper).float().mean().item()
        if use_lower:
            m[f"{p}_seq_fraction_low"] = (seq_values < lower).float().mean().item()
    else:
        m |= {f"{p}_seq_{k}": 0.0 for k in ("mean", "std", "max", "min", "max_deviation", "fraction_high")}
        m[f"{p}_seq_fraction_low"] = 0.0
    return m


def compute_offpolicy_metrics(
    old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor | None, response_mask: torch.Tensor
) -> dict[str, float]:
    """Off-policy diagnostics (no prefix), with π = `old_log_prob`, μ = `rollout_log_prob`, per-row means ⟨·⟩_i:

    training_ppl = mean_i exp(−⟨log π⟩_i)       rollout_ppl likewise;  *_log_ppl = mean_i −⟨log ·⟩_i
    kl     = mean_t (log μ − log π)              k3_kl = mean_t (ρ − log ρ − 1),  ρ = π/μ
    log_ppl_diff(_max/_min) = mean/max/min_i (⟨log μ⟩_i − ⟨log π⟩_i);  log_ppl_abs_diff, ppl_ratio = mean exp
    chi2_token = mean_t ρ_t² − 1                 chi2_seq = mean_i exp(2·clamp(Σ_t log ρ_t, ±20)) − 1
    """
    if not response_mask.any():
        raise ValueError("off-policy metrics need at least one response token")
    mean_train = masked_mean(old_log_prob, response_mask, dim=-1)
    m = {"training_ppl": torch.exp(-mean_train).mean().item(), "training_log_ppl": (-mean_train).mean().item()}
    if rollout_log_prob is None:
        return m
    log_ratio = old_log_prob - rollout_log_prob
    m["kl"] = masked_mean(rollout_log_prob - old_log_prob, response_mask).item()
    m["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, response_mask).item()
    mean_rollout = masked_mean(rollout_log_prob, response_mask, dim=-1)
    m["rollout_ppl"] = torch.exp(-mean_rollout).mean().item()
    m["rollout_log_ppl"] = (-mean_rollout).mean().item()
    diff = mean_rollout - mean_train
    m |= {"log_ppl_diff": diff.mean().item(), "log_ppl_abs_diff": diff.abs().mean().item(),
          "log_ppl_diff_max": diff.max().item(), "log_ppl_diff_min": diff.min().item(),
          "ppl_ratio": torch.exp(diff).mean().item()}  # fmt: skip
    rho = torch.exp(torch.clamp(log_ratio, min=-SAFETY_BOUND, max=SAFETY_BOUND))
    m["chi2_token"] = (masked_mean(rho.square(), response_mask) - 1.0).item()
    log_ratio_sum = torch.clamp(masked_sum(log_ratio, response_mask, dim=-1), min=-SAFETY_BOUND, max=SAFETY_BOUND)
    m["chi2_seq"] = (torch.exp(2.0 * log_ratio_sum).mean() - 1.0).item()
    return m


def compute_rollout_correction_and_rejection_mask(
    old_log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    rollout_is: str | None = None,
    rollout_is_threshold: str | float | None = 2.0,
    rollout_is_batch_normalize: bool = False,
    rollout_rs: str | None = None,
    rollout_rs_threshold: str | float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
    """Weights (None unless `rollout_is` and a threshold are set), the response mask after rejection, and every
    metric prefixed `rollout_corr/` (verl's function; verl wraps the weights in a DataProto)."""
    if not response_mask.any():
        raise ValueError("response_mask must contain at least one valid token (1).")
    if old_log_prob.shape != rollout_log_prob.shape or old_log_prob.shape != response_mask.shape:
        raise ValueError(f"shapes differ: old_log_prob {tuple(old_log_prob.shape)}, rollout_log_prob "
                         f"{tuple(rollout_log_prob.shape)}, response_mask {tuple(response_mask.shape)}")  # fmt: skip
    log_ratio = old_log_prob - rollout_log_prob
    metrics: dict[str, float] = {}
    weights = None
    if rollout_is is not None and rollout_is_threshold is not None:
        weights, is_metrics = compute_rollout_correction_weights(
            log_ratio, response_mask, rollout_is, rollout_is_threshold, rollout_is_batch_normalize
        )
        metrics |= is_metrics
    mask = response_mask.clone()
    if rollout_rs is not None:
        mask, rs_metrics = compute_rollout_rejection_mask(log_ratio, response_mask, rollout_rs, rollout_rs_threshold)
        metrics |= rs_metrics
    metrics |= compute_offpolicy_metrics(old_log_prob, rollout_log_prob, response_mask)
    return weights, mask, {f"rollout_corr/{key}": value for key, value in metrics.items()}
