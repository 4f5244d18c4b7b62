"""Packed sequences with learned absolute positions at PP2 and PP2×VPP2 under token budgets, against the same model
on one process, padded: the positions of a pack are one fact (`Pack.position_ids`, padding at 0), which the first
stage's position embedding reads. The pass's shape (every pack as wide as its largest) used to carry the last
sequence's positions past the table (`IndexError: index out of range` in Megatron's position embedding). RoPE at the
same layouts: `test_parallel_parity.py` (pp2-packed, pp2-vpp2-dynamic-packed)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from megatron_ppo.config.schema import MegatronConfig
from tests.distributed import workers
from tests.distributed.harness import run_distributed
from tests.distributed.parity_checks import (
    assert_experience_matches,
    assert_grad_norms_and_weights_match,
    assert_update_metrics_match,
)

# the position table as long as the longest row (3–6 prompt + 1–7 response tokens): a pack's tail runs past it
LEARNED = dataclasses.replace(workers.MODEL, position_embedding_type="learned_absolute", max_position_embeddings=13)
LAYOUTS = {
    "pp2-dynamic-packed": (2, MegatronConfig(pipeline_model_parallel_size=2)),
    "pp2-vpp2-dynamic-packed": (
        2,
        MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ),
}
MAX_TOKENS = 30  # token budgets: packs of 2–3 rows, each pass as wide as its widest pack


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    workdir = str(tmp_path_factory.mktemp("packed-positions"))
    run_distributed(workers.reference, 1, workdir, LEARNED, False)
    reports = workers.run_layouts(run_distributed, workdir, LAYOUTS, dict.fromkeys(LAYOUTS, MAX_TOKENS), LEARNED,
                                  packed=set(LAYOUTS))  # fmt: skip
    weights = run_distributed(workers.compare_updated_weights, 1, workdir, list(LAYOUTS), LEARNED)[0]
    return {"reports": reports, "weights": weights, "workdir": Path(workdir)}


@pytest.mark.parametrize("name", LAYOUTS)
def test_learned_positions_pack_through_the_pipeline_as_one_process_runs_them(parity, name: str) -> None:
    reports = parity["reports"][name]
    widths = {shape[0] for report in reports for seen in report["pipeline_passes"] for shape in seen["shapes"]}
    assert max(widths) > LEARNED.max_position_embeddings, f"{name}: no pack longer than the position table {widths}"
    assert_experience_matches(reports, name, "one process, padded")
    assert_update_metrics_match(reports, name, {"actor/pg_loss", "actor/kl_loss", "critic/vf_loss"})
    assert_grad_norms_and_weights_match(parity, name)
