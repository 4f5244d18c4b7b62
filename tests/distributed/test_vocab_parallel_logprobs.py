"""Vocabulary-parallel log-probs and entropy equal a full log-softmax, without any rank holding the full vocab."""

from __future__ import annotations

import pytest

from tests.distributed import logprob_workers
from tests.distributed.harness import run_distributed


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vocab_parallel_log_probs_match_full_log_softmax_without_materialising_it(temperature: float) -> None:
    for rank, report in enumerate(run_distributed(logprob_workers.compare_with_full_softmax, 2, temperature)):
        for key in ("log_prob", "entropy", "grad"):
            assert report[key] < 1e-5, f"rank {rank}: {key} differs from the full softmax by {report[key]:.2e}"
        assert report["largest_tensor"] < report["full_vocab_tensor"], (
            f"rank {rank} built a tensor of {report['largest_tensor']} elements, as large as the full-vocabulary "
            f"logits ({report['full_vocab_tensor']})"
        )
