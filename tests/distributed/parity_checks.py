"""The assertions every layout-parity test makes of one layout against its single-layout reference."""

from __future__ import annotations

import math


def assert_experience_matches(reports: list[dict], name: str, reference: str) -> None:
    """Every rank's experience (old and reference log-probs, values) equals the `reference` layout's within 1e-5."""
    for report in reports:
        for key in ("old_log_prob", "ref_log_prob", "values"):
            assert report[key] < 1e-5, f"{name}: {key} differs from {reference} by {report[key]:.2e}"


def assert_update_metrics_match(reports: list[dict], name: str, required: set[str]) -> None:
    """Every rank's update metrics equal the reference's (`{key: (ours, reference)}`)."""
    for report in reports:
        assert required <= set(report["metrics"]), f"{name}: missing {required - set(report['metrics'])}"
        for key, (ours, reference) in report["metrics"].items():
            assert math.isclose(ours, reference, rel_tol=1e-4, abs_tol=1e-6), f"{name}: {key} {ours} vs {reference}"


def assert_grad_norms_and_weights_match(parity: dict, name: str) -> None:
    """Each role's grad norm on every rank, and its weights after one clipped optimizer step, equal the reference's."""
    for report in parity["reports"][name]:
        for role in ("actor", "critic", "gspo"):
            if f"{role}_grad_norm" not in report:
                continue
            ours, reference = report[f"{role}_grad_norm"]
            assert math.isclose(ours, reference, rel_tol=1e-5), f"{name}: {role} grad norm {ours} vs {reference}"
    for role in ("actor", "critic"):
        diff = parity["weights"][f"{name}/{role}"]
        assert diff < 1e-6, f"{name}: {role} weights after one clipped optimizer step differ by {diff:.2e}"
