"""MoE routing replay (R2) through the trainer's own experience pass and actor update, on a tiny MoE model: the
update's forwards route as the old-log-prob pass recorded (log-probs equal to the old ones before any step), keep
those routes after a step while the router still learns, consume each record once under full recompute, never touch
a neighbouring model's routers; and EP 2, TP 2 (with sequence parallelism) and PP 2 × VPP 2 (layer offsets per
stage and virtual chunk) record the same routes as EP 1 and replay them alike; R3 replays the rows' routes; packed
sequences at each of these layouts record and replay as its padded passes do. (Context parallelism needs
Transformer Engine's attention: not on CPU.)"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ppo.config.schema import MegatronConfig
from tests.distributed import replay_workers
from tests.distributed.harness import run_distributed

LAYOUTS = {
    "ep2": MegatronConfig(expert_model_parallel_size=2),
    "tp2-sp": MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2-vpp2": MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    workdir = str(tmp_path_factory.mktemp("replay"))
    out = {"ep1": run_distributed(replay_workers.replay_run, 1, workdir, MegatronConfig(), True, True)}
    for name, layout in LAYOUTS.items():  # each also runs its experience and update packed
        out[name] = run_distributed(replay_workers.replay_run, 2, workdir, layout, False, True)
    return out


def test_first_forward_routes_as_recorded(runs) -> None:
    """Before any step the update's log-probs are the old ones (the same routes, in other micro-batches); a wrong
    row, token or layer for a record would route a token elsewhere and change its log-prob."""
    report = runs["ep1"][0]
    for run in report["runs"].values():
        assert run["epochs"][0]["old_gap"] < 1e-5
        assert run["epochs"][0]["router_replay_mismatch"] == 0.0


def test_routes_stay_recorded_after_a_step_and_the_router_learns(runs) -> None:
    """After the first step the live routers would move some tokens (mismatch > 0, and a fresh record differs),
    yet the update keeps the recorded routes; the router weights get gradients through the gathered scores."""
    report = runs["ep1"][0]
    plain = report["runs"]["plain"]
    assert plain["epochs"][1]["router_replay_mismatch"] > 0.0
    assert report["drift_after_update"] > 0.0
    assert plain["router_grads"] and min(plain["router_grads"]) > 0.0


def test_recompute_consumes_each_record_once(runs) -> None:
    """Under full recompute every replayed forward's targets are popped once by its backward (nothing left in
    Megatron's queues), and the update is the one without recompute (the recompute routed as recorded)."""
    report = runs["ep1"][0]
    plain, recompute = report["runs"]["plain"], report["runs"]["recompute"]
    assert all(left == 0 for counts in recompute["left"] for left in counts)
    assert all(left > 0 for counts in plain["left"] for left in counts)  # without recompute nothing pops them
    for a, b in zip(plain["epochs"], recompute["epochs"], strict=True):
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-6)
        assert math.isclose(a["pg_loss"], b["pg_loss"], rel_tol=1e-6, abs_tol=1e-9)


def test_r3_replays_the_rows_routes(runs) -> None:
    """Rows carrying the R2 record as `routed_experts` give R2's old log-probs in the R3 first pass (the rows'
    routes replayed, through `collate`); moved to other experts, they give other log-probs."""
    r3 = runs["ep1"][0]["r3"]
    assert r3["same"] < 1e-6
    assert r3["moved"] > 1e-2


def test_records_bound_to_the_actor_only(runs) -> None:
    """The reference, built with replay before the actor (first on Megatron's global list), is never armed: its
    routers route live (its log-probs match the EP 1 run's own reference), and the actor binds only its own."""
    for name, ranks in runs.items():
        for report in ranks:
            assert report["ref_untouched"], name
            assert report["global_instances"] >= report["actor_instances"] + report["ref_instances"]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_record_and_replay_as_ep1(runs, name: str) -> None:
    expected = runs["ep1"][0]
    real = expected["real"]
    for report in runs[name]:
        routes = report["passes"]["routed_experts"]
        assert torch.equal(routes[real], expected["passes"]["routed_experts"][real]), name
        gap = ((report["passes"]["old_log_prob"] - expected["passes"]["old_log_prob"]).abs()).max()
        assert gap < 1e-4, name
        for ours, theirs in zip(report["runs"]["plain"]["epochs"], expected["runs"]["plain"]["epochs"], strict=True):
            if ours["old_gap"] is not None:
                assert ours["old_gap"] < 1e-4 or theirs["old_gap"] > 1e-5, name
            assert math.isclose(ours["grad_norm"], theirs["grad_norm"], rel_tol=1e-3), name
            assert math.isclose(ours["router_replay_mismatch"], theirs["router_replay_mismatch"], abs_tol=0.02), name


@pytest.mark.parametrize("name", ["ep1", *LAYOUTS])
def test_packed_passes_record_and_replay_as_padded(runs, name: str) -> None:
    """Packed sequences, the experience packed by one token budget and the update by another (other groups than the
    padded passes' too; with SP each rank holds a contiguous part of the pack; with PP each stage its layers; on
    one process under full recompute, whose backward pops each packed forward's targets once): the record holds
    each real token's experts exactly as the padded pass's (0 at padding in both), the first update forward routes
    as recorded (a token replayed at another token's pack position would change its log-prob and the mismatch),
    and the update's losses, grad norms and mismatch are the padded update's within fp32 rounding."""
    if name == "ep1":
        assert all(left == 0 for counts in runs[name][0]["runs"]["packed"]["left"] for left in counts)
    for report in runs[name]:
        packed, padded, real = report["packed_passes"], report["passes"], report["real"]
        assert any("packed sequences" in note for note in packed["notes"]), packed["notes"]
        assert torch.equal(packed["routed_experts"], padded["routed_experts"])
        assert not padded["routed_experts"][~real].any() and padded["routed_experts"][real].all()
        assert float(((packed["old_log_prob"] - padded["old_log_prob"]).abs() * real).max()) < 1e-6
        ours, theirs = report["runs"]["packed"]["epochs"], report["runs"]["plain"]["epochs"]
        assert ours[0]["old_gap"] < 1e-6 and ours[0]["router_replay_mismatch"] == 0.0
        for a, b in zip(ours, theirs, strict=True):
            assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-5), (a, b)
            assert math.isclose(a["pg_loss"], b["pg_loss"], rel_tol=1e-5), (a, b)
            assert math.isclose(a["old_gap"], b["old_gap"], rel_tol=1e-4, abs_tol=1e-6), (a, b)
            assert a["router_replay_mismatch"] == b["router_replay_mismatch"], (a, b)
