"""KV-cached decoding (Megatron-Core's static inference context) gives the uncached decoder's tokens: greedy with
prompts of different lengths and rows ending at an EOS mid-way, and sampled from one seed, at TP1 with DP2 (each
replica its share), TP2, TP2 with sequence parallelism, PP2, PP2 with two virtual stages and EP2 (MoE), on one
2-process world re-laid out between layouts."""

from __future__ import annotations

import pytest

from tests.distributed import generation_workers
from tests.distributed.harness import run_distributed


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_distributed(generation_workers.cached_against_uncached, 2, list(generation_workers.LAYOUTS))


@pytest.mark.parametrize("name", list(generation_workers.LAYOUTS))
def test_cached_decoding_gives_the_uncached_tokens(reports, name) -> None:
    for rank, report in enumerate(reports):
        got = report[name]
        answers, uncached = got["cached"], got["uncached"]
        assert len(answers) == 7, f"{name}, rank {rank}: {len(answers)} answers for 7 prompts"
        ended = [done for _, done in uncached]
        assert any(ended) and not all(ended), f"{name}: the EOS {got['eos']} should end some rows, not all: {ended}"
        assert answers == uncached, f"{name}, rank {rank}: cached {answers} != uncached {uncached}"
        assert got["sampled_cached"] == got["sampled_uncached"], f"{name}, rank {rank}: sampled answers differ"


def test_decode_bench_runs_at_its_smallest_size() -> None:
    (out,) = run_distributed(generation_workers.bench_smallest, 1)
    assert set(out) == {"speedup_4", "speedup_8", "growth_cached", "growth_uncached"}
    assert all(value > 0 for value in out.values()), out
