"""The GPU check sized to the card it gets, checked on the CPU: every real part planned within an 80 GB H100's and a
141 GB H200's budget (the planner counting the local spec the check's GPU runs), the parts the driver would run
together within it too, (d) measured alone, a part needing two GPUs skipped without a process, and `--budget`
leaving out the least valued parts by name."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest

from gpu_check import __main__ as driver
from gpu_check import first_update, grad_cut, offload, ppo_iteration, resume, schedule
from gpu_check.card import named_card
from gpu_check.parts import Part, parts_of
from gpu_check.plan import REAL, ppo_config
from gpu_check.sizing import DISK_GB_S, HOST_GB_S, NEGLIGIBLE, PASS_SHARE, Sized
from megatron_ppo.planner import plan as planner

CARDS = ("h100", "h200")


def _real(card: str):
    return dataclasses.replace(REAL, card=named_card(card))


@pytest.mark.parametrize("card", CARDS)
def test_the_dry_run_for_a_card_plans_every_part_within_its_budget(card: str, tmp_path: Path, capsys) -> None:
    """`make gpu-check DRY_RUN=1 CARD=…`: exit 0, every part's planned peak and every set of parts the schedule
    runs together within the budget; the plan written as JSON."""
    out = tmp_path / "plan.json"
    assert driver.main(["--dry-run", "--card", card, "--out", str(out)]) == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    budget = named_card(card).budget_gib
    assert report["problems"] == [] and report["budget_gib"] == pytest.approx(budget)
    sized = report["sized"]
    assert set(sized) == {part.key for part in parts_of(REAL)}
    assert all(part["fits"] and part["planned_gib"] <= budget for part in sized.values()), sized
    planned = {key: part["planned_gib"] for key, part in sized.items()}
    slots = [schedule.Slot(**slot) for slot in report["schedule"]]
    assert not schedule.overcommitted(slots, planned.__getitem__, budget)
    printed = capsys.readouterr().out
    assert f"{card}: every part fits" in printed and "64 rows × 1024 tokens" in printed


def test_grad_cut_runs_a_cut_1_that_fits_where_the_whole_mini_batch_did_not() -> None:
    """(e): 64 rows × 1024 tokens in one micro-batch (today's before this sizing) plans ≈ 268 GiB; sized, cut 1 is a
    mini-batch of at least 4 rows in one micro-batch, planned within each card's budget."""
    for card in CARDS:
        plan = _real(card)
        whole = ppo_config(plan, dataclasses.replace(plan.base_shape(1024), micro_batch=plan.rows))
        assert planner.plan(whole).peak_gib > 250
        sized = grad_cut.size(plan)
        shape = sized.shape
        assert shape.micro_batch == shape.rows >= max(grad_cut.CUTS) and shape.rows % max(grad_cut.CUTS) == 0
        assert sized.fits and planner.plan(ppo_config(plan, shape)).peak_gib <= plan.card.budget_gib


def test_parts_shrink_rows_first_then_length_and_keep_the_width() -> None:
    """On the H100, (b) at 1024 tokens keeps its 64 rows × 1024 with 2 rows a micro-batch (4 plans 75.5 GiB over
    71.6); at 4096 one row a micro-batch is still over, so its rows are halved to 2048 tokens (micro-batches of 4, 2
    and 1 row tried again at that length); on the H200 both run as written. Every shape keeps the 28 layers."""
    h100, h200 = _real("h100"), _real("h200")
    b1024, b4096 = ppo_iteration.size(h100, 1024), ppo_iteration.size(h100, 4096)
    assert (b1024.shape.rows, b1024.shape.seq, b1024.shape.micro_batch, b1024.shape.layers) == (64, 1024, 2, 28)
    assert (b4096.shape.seq, b4096.shape.micro_batch, b4096.shape.layers) == (2048, 1, 28)
    tried = [line.split(", 28 layers")[0] for line in b4096.tried]
    assert tried == [f"16 rows × {seq} tokens, micro-batch {micro}" for seq, micro in
                     ((4096, 4), (4096, 2), (4096, 1), (2048, 4), (2048, 2))], b4096.tried  # fmt: skip
    for seq in (1024, 4096):
        shape = ppo_iteration.size(h200, seq).shape
        assert (shape.seq, shape.micro_batch) == (seq, 4)
    for size in (offload.size, first_update.size, resume.size):
        assert size(h100).fits and size(h200).fits


def test_the_planner_counts_the_local_spec_the_check_runs() -> None:
    """`model.transformer_impl=local` on CUDA: each layer keeps x/rms of its two norms (2·h·e per token) and the
    unfused RoPE's cos and sin (4·d·e per row position) beyond Transformer Engine's count — the (b) update's peak
    grows by exactly that over 28 layers at its micro-batch."""
    plan = _real("h200")
    shape = plan.base_shape(1024)
    local = ppo_config(plan, shape, pack_sequences=True)
    assert local.model.transformer_impl == "local"  # no Transformer Engine here, as on the check's GPU
    te = dataclasses.replace(local, model=dataclasses.replace(local.model, transformer_impl="auto"))
    h, d, e = 1536, 128, 2
    tokens = shape.micro_batch * shape.seq
    expected = 28 * tokens * (2 * h * e + 4 * d * e / shape.micro_batch) / 2**30
    difference = planner.plan(local).roles["actor"].activations_gib - planner.plan(te).roles["actor"].activations_gib
    assert difference == pytest.approx(expected, rel=1e-9)
    assert planner.layer_kernels(local, "actor") == planner.LOCAL_CUDA_KERNELS
    assert planner.layer_kernels(te, "actor") == planner.TE_KERNELS


def test_offload_runs_alone_and_parts_share_the_card_only_within_its_budget() -> None:
    """(d) measures the offload's transfers: nothing beside it. (f) (28 GiB planned) beside (g) (69–76 GiB): over an
    H100's 71.6 GiB, within an H200's 126.4."""
    for card in CARDS:
        plan = _real(card)
        parts = {part.key: part for part in parts_of(plan)}
        planned = {key: part.size(plan).planned_gib for key, part in parts.items()}
        budget = plan.card.budget_gib
        assert parts["d"].exclusive
        assert not schedule.admits(parts["f"], [parts["d"]], planned.__getitem__, 2, budget)
        beside = schedule.admits(parts["f"], [parts["g"]], planned.__getitem__, 2, budget)
        assert beside == (card == "h200"), (card, planned["f"], planned["g"], budget)


def _part(key: str, exclusive: bool = False) -> Part:
    return Part(key, key[0], lambda plan, work: {"ok": True}, lambda result: [], exclusive=exclusive)


def test_the_simulated_schedule_follows_the_drivers_rule() -> None:
    """An exclusive part waits for an idle card and holds back the parts behind it; the others pair while their
    planned peaks fit."""
    parts = [_part("x"), _part("j", exclusive=True), _part("p"), _part("q")]
    seconds = {"x": 10.0, "j": 5.0, "p": 4.0, "q": 6.0}.__getitem__
    planned = {"x": 30.0, "j": 1.0, "p": 30.0, "q": 50.0}.__getitem__
    slots = {slot.key: slot for slot in schedule.simulate(parts, seconds, planned, jobs=2, budget_gib=70.0)}
    assert (slots["x"].start_s, slots["j"].start_s) == (0.0, 10.0), "(j) waits for the card to itself"
    assert slots["p"].start_s == 15.0 and slots["q"].start_s == slots["p"].end_s, "30 + 50 GiB > 70: q waits"
    together = {"x": 30.0, "j": 1.0, "p": 30.0, "q": 30.0}.__getitem__
    slots = {s.key: s for s in schedule.simulate(parts, seconds, together, jobs=2, budget_gib=70.0)}
    assert slots["p"].start_s == slots["q"].start_s == 15.0, "30 + 30 GiB ≤ 70: they pair"


def test_the_budget_leaves_out_the_least_valued_parts_by_name(tmp_path: Path, capsys) -> None:
    """On an H200 the whole check is estimated beyond six minutes; with `--budget 330` the least valued parts
    ((b) at 4096 first, then (j), (e), (d)) are left out, by name, and the estimate fits."""
    out = tmp_path / "plan.json"
    assert driver.main(["--dry-run", "--card", "h200", "--budget", "330", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["left_out"][:2] == ["b4096", "j"], report["left_out"]
    assert report["estimated_s"] <= 330
    kept = {slot["key"] for slot in report["schedule"]}
    assert {"a", "b1024", "c"} <= kept and not kept & set(report["left_out"])
    assert "left out for time: b4096, j" in capsys.readouterr().out


def test_a_part_needing_two_gpus_is_skipped_without_a_process(tmp_path: Path, monkeypatch, capsys) -> None:
    """(h) on a machine with fewer GPUs: reported skipped at once, no process started for it (the check used to
    spawn it and start NCCL for ~15 s to print the same)."""
    monkeypatch.setattr(driver, "PRELOAD", [__name__])
    plan = dataclasses.replace(REAL, card=named_card("h100"))
    parts = [dataclasses.replace(part, size=lambda plan: NEGLIGIBLE) for part in parts_of(plan) if part.letter == "h"]
    out = tmp_path / "gpu_check.json"
    started = time.perf_counter()
    status = driver.Check(plan, parts, out, tmp_path / "work", jobs=2, part_timeout=30).run()
    assert status == 0 and time.perf_counter() - started < 5
    results = json.loads(out.read_text())["parts"]
    assert set(results) == {"h", "h_recipe"} and all(r["skipped"] == "0 GPU visible" for r in results.values())
    assert "started" not in capsys.readouterr().out
    assert not (tmp_path / "work" / "h").exists()


def test_a_sized_estimate_adds_its_work_at_the_cards_rate() -> None:
    sized = Sized(None, 1.0, True, flops=1e15, transfer_gb=20.0, disk_gb=3.0, fixed_s=10.0)
    card = named_card("h100")

    expected = 10.0 + 1e15 / (card.matmul_tflops * 1e12 * PASS_SHARE) + 20.0 / HOST_GB_S + 3.0 / DISK_GB_S
    assert sized.seconds(card) == pytest.approx(expected)
