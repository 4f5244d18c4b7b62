"""Mixture-of-experts actor and critic under expert parallelism — EP 2, EP 2 × expert-TP 2 (each expert's
weights split over two ranks), and attention TP 2 with sequence parallelism beside EP 2 (Megatron trains MoE at
attention TP > 1 only with sequence parallelism; Qwen3-235B's layout) — against the same weights at EP 1 on one
process, through the trainer's own experience and update path. Tolerances are the dense layouts' (see
test_parallel_parity.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from megatron_ppo.config.schema import MegatronConfig
from tests.distributed import moe_workers, workers
from tests.distributed.harness import run_distributed
from tests.distributed.parity_checks import (
    assert_experience_matches,
    assert_grad_norms_and_weights_match,
    assert_update_metrics_match,
)

# Qwen3-MoE-shaped: QK layernorm, SwiGLU experts, normalised top-2 of 4, grouped-query attention
MOE_MODEL = dataclasses.replace(
    workers.MODEL, name="parity-moe", num_layers=2, qk_layernorm=True, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=48,
)  # fmt: skip
# Megatron's load-balancing loss is a statistic of each micro-batch on each data-parallel replica, so it depends on
# how rows are spread over replicas: the layout tests run without it, and it is compared at equal data parallelism.
WITH_AUX_LOSS = dataclasses.replace(MOE_MODEL, router_aux_loss_coef=0.01)
LAYOUTS = {
    "ep2": (2, MegatronConfig(expert_model_parallel_size=2)),
    "ep2-etp2": (4, MegatronConfig(expert_model_parallel_size=2, expert_tensor_parallel_size=2)),
    "tp2-sp-ep2": (
        4,
        MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2),
    ),
}


@pytest.fixture(scope="module")
def parity(tmp_path_factory) -> dict:
    workdir = str(tmp_path_factory.mktemp("ep-parity"))
    run_distributed(workers.reference, 1, workdir, MOE_MODEL)
    reports = workers.run_layouts(run_distributed, workdir, LAYOUTS, model=MOE_MODEL)
    weights = run_distributed(workers.compare_updated_weights, 1, workdir, list(LAYOUTS), MOE_MODEL)[0]
    aux = run_distributed(moe_workers.load_balancing_loss_by_layout, 2, workdir, WITH_AUX_LOSS)
    table = ["layout   old_log_prob  ref_log_prob  values    actor grad norm  critic grad norm  weights a/c"]
    for name, ranks in reports.items():
        report = ranks[0]
        norms = [
            abs(report[f"{role}_grad_norm"][0] / report[f"{role}_grad_norm"][1] - 1) for role in ("actor", "critic")
        ]
        table.append(f"{name:8s} {report['old_log_prob']:.1e}       {report['ref_log_prob']:.1e}       "
                     f"{report['values']:.1e}   {norms[0]:.1e} (rel)      {norms[1]:.1e} (rel)       "
                     f"{weights[f'{name}/actor']:.1e}/{weights[f'{name}/critic']:.1e}")  # fmt: skip
    print("\n" + "\n".join(table))
    return {"reports": reports, "weights": weights, "aux": aux}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_experience_matches_ep1_on_every_rank(parity, name: str) -> None:
    assert_experience_matches(parity["reports"][name], name, "EP=1")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_update_metrics_match_ep1(parity, name: str) -> None:
    required = {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "critic/vf_loss"}
    assert_update_metrics_match(parity["reports"][name], name, required)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_grad_norm_and_updated_weights_match_ep1(parity, name: str) -> None:
    assert_grad_norms_and_weights_match(parity, name)


def test_load_balancing_loss_is_logged_and_trained_through_expert_parallelism(parity) -> None:
    for rank, runs in enumerate(parity["aux"]):
        dp2, ep2, no_aux = runs["dp2"], runs["ep2"], runs["ep2-no-aux"]
        assert 0.9 <= ep2["moe_aux_loss"] < 2.0, f"rank {rank}: {ep2['moe_aux_loss']} (~1: balanced routing)"
        assert no_aux["moe_aux_loss"] is None, "no actor/moe_aux_loss without the loss"
        for key in ("moe_aux_loss", "grad_norm", "pg_loss"):
            assert math.isclose(ep2[key], dp2[key], rel_tol=1e-5), f"rank {rank}: {key} EP 2 {ep2[key]} vs {dp2[key]}"
        assert ep2["pg_loss"] == no_aux["pg_loss"], "the load-balancing loss is not part of the logged pg_loss"
        assert not math.isclose(ep2["grad_norm"], no_aux["grad_norm"], rel_tol=1e-6), "the loss must reach the grads"
