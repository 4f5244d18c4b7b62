"""Vocabulary-parallel log-probs and entropy equal a full log-softmax, without any rank holding the full vocab."""

from __future__ import annotations

import pytest

from tests.distributed import logprob_workers
from tests.distributed.harness import run_distributed

TOKENS = logprob_workers.BATCH * logprob_workers.SEQ
CHUNKS = [None, 4, 1]  # all tokens at once; 15 tokens in chunks of 4 (a short last chunk); one token at a time


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_log_probs_match_full_log_softmax_in_any_chunking(temperature: float) -> None:
    for rank, reports in enumerate(run_distributed(logprob_workers.compare_with_full_softmax, 2, temperature, CHUNKS)):
        full, width = reports.pop("full_vocab_tensor"), reports.pop("width")
        for chunk, report in reports.items():
            for key in ("log_prob", "entropy", "grad"):
                assert report[key] < 1e-5, (
                    f"rank {rank}, chunk_tokens={chunk}: {key} differs from the full softmax by {report[key]:.2e}"
                )
            assert report["largest_tensor"] < full, (
                f"rank {rank} built a tensor of {report['largest_tensor']} elements, as large as the "
                f"full-vocabulary logits ({full})"
            )
            # from bf16 logits, float32 exists only per chunk [chunk, vocab / TP] and per token (log p(y) and H,
            # [2, tokens]); the gradient is bf16 like the logits
            bound = max((chunk or TOKENS) * width, 2 * TOKENS)
            assert report["largest_fp32_from_bf16"] <= bound, (
                f"rank {rank}, chunk_tokens={chunk}: a float32 tensor of {report['largest_fp32_from_bf16']} "
                f"elements, more than one chunk or the per-token results ({bound})"
            )
            assert report["bf16_grad_dtype"] == "torch.bfloat16"


def test_the_width_bucket_keeps_one_logits_buffer_with_its_gradient_in_place() -> None:
    """40-token rows padded to 128 (the CUDA bucket, forced): the forward-backward creates one tensor the size of
    the real tokens' logits — the logits themselves, computed for the real tokens only — and their gradient is
    written into it, as without the bucket (a cut of padded logits would add a copy each way and a padded gradient
    buffer)."""
    (report,) = run_distributed(logprob_workers.logits_buffers_under_the_width_bucket, 1)
    assert report["128"]["padded"] == 4 * 128 and report["None"]["padded"] == 4 * 40, report
    for bucket in ("None", "128"):
        assert report[bucket] == {**report[bucket], "logits_sized": 1, "in_place": True}, report
