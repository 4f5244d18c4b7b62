"""The MoE layer Megatron builds from our config routes and mixes experts as Hugging Face's Qwen3-MoE does."""

from __future__ import annotations

from tests.distributed import moe_workers
from tests.distributed.harness import run_distributed


def test_moe_layer_matches_transformers_qwen3_moe_block_with_and_without_top_k_normalisation() -> None:
    differences = run_distributed(moe_workers.layer_against_transformers, 1)[0]
    print(f"\nlargest difference from transformers' Qwen3MoeSparseMoeBlock: {differences}")
    assert len(differences) == 2
    for case, difference in differences.items():
        assert difference < 1e-5, f"{case}: the MoE layer differs from transformers by {difference:.2e}"
