"""SDPA core attention equals Megatron's DotProductAttention (fp32), forward and gradients, GQA and masks."""

from __future__ import annotations

import pytest

from tests.distributed import attention_workers
from tests.distributed.harness import run_distributed

CASES = [(kind, groups) for kind in ("causal", "causal+padding") for groups in (4, 2)]  # MHA and GQA


def test_sdpa_core_attention_matches_megatron_dot_product_attention() -> None:
    (reports,) = run_distributed(attention_workers.compare_with_dot_product_attention, 1, CASES)
    for (kind, groups), report in reports.items():
        assert report["output_scale"] > 0.1, f"{kind}, {groups} groups: the outputs are all zero, nothing compared"
        for key in ("forward", "grad_q", "grad_k", "grad_v"):
            assert report[key] < 1e-5, (
                f"{kind}, {groups} query groups: {key} differs from DotProductAttention by {report[key]:.2e}"
            )


@pytest.mark.parametrize("bucket", [None, 128], ids=["cpu widths", "cuda bucket forced"])
def test_the_start_line_names_the_attention_kernel_a_training_step_runs(bucket: int | None) -> None:
    """The tiny recipe's actor in bf16, a forward-backward of one micro-batch: `sdpa_backend` (the start line's
    kernel) names the one kernel the profiler saw run, for the rows, width and gradients of training."""
    (report,) = run_distributed(attention_workers.attention_kernel_of_a_training_step, 1, bucket)
    assert report["padded"] == (bucket or 13), report
    assert report["ran"] == [report["named"]], report
