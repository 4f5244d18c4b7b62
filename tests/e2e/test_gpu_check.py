"""`make gpu-check --dry-run`: the GPU check's every part, on the CPU with a tiny model (part (h)'s layouts on 2 gloo
processes), so the script cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_runs_every_part_and_writes_its_table(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "bench.gpu_check", "--dry-run", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    report = json.loads(out.read_text())
    parts = [report["a_tiny_recipe"], *report["b_ppo_iteration"], report["c_logprobs"], report["d_offload"],
             report["e_grad_norm_by_cut"], report["f_resume"], report["g_first_update"], report["h_layouts"],
             report["h_tiny_recipe_tp2_sp"], report["i_decode"]]  # fmt: skip
    assert all(part["ok"] for part in parts), parts
    # (a) and (h)'s recipe trained through the CLI (the CUDA width bucket forced), not only validated
    for recipe in (report["a_tiny_recipe"], report["h_tiny_recipe_tp2_sp"]):
        assert recipe["exit_code"] == 0 and "accuracy_after" in recipe and recipe["accuracy_judged"] is False, recipe
    assert report["f_resume"]["metrics_compared"] > 10 and report["f_resume"]["grad_norm_rtol"] == 0.0, "bitwise on CPU"
    offload = report["d_offload"]
    assert set(offload["on"]["resident_gib"]) == set(offload["off"]["resident_gib"]) == {
        "experience", "critic update", "actor update", "between iterations"}  # fmt: skip
    assert offload["on"]["resident_gib"]["actor update"] < offload["off"]["resident_gib"]["actor update"]
    assert offload["on"]["planned_peak_gib"] < offload["off"]["planned_peak_gib"]
    assert [b["seq"] for b in report["b_ppo_iteration"]] == [32, 64]
    assert all(b["mfu_iteration"] > 0 and b["iteration_over_bare"] > 0 for b in report["b_ppo_iteration"])
    # (b) ran packed (THD) in every pass of every role, rows of one length: nothing computed but the real tokens
    for b in report["b_ppo_iteration"]:
        assert b["computed_over_real"] == 1.0, b
        assert {note.split(":")[0] for note in b["pass_notes"] if "packed sequences" in note} == {
            "actor passes", "ref passes", "critic passes"}, b["pass_notes"]  # fmt: skip
    first = report["b_ppo_iteration"][0]
    assert first["padded_iteration_s"] > 0 and first["padded_computed_over_real"] == 1.0, first
    assert "sequences packed (THD" in report["kernels"]
    assert "scaled_dot_product_attention" in report["kernels"], "the table must say which attention path ran"
    assert "(b) PPO iteration" in result.stdout and "(c) log-probs bf16 vs CPU fp32" in result.stdout
    assert "(d) host offload" in result.stdout
    # (h) on 2 CPU processes (gloo): TP2 + SP and PP2 ran and were compared with TP1 in fp32, not skipped
    layouts = report["h_layouts"]
    assert layouts["dtype"] == "fp32" and set(layouts["layouts"]) == {"tp2-sp", "pp2"}, layouts
    assert all(step > 10 * layouts["tolerance"]["weights"] for step in layouts["reference_step"].values()), layouts
    assert report["h_tiny_recipe_tp2_sp"]["processes"] == 2, "the TP2 + SP recipe ran on 2 processes"
    assert "(h) TP2 + SP and PP2 against TP1 (fp32)" in result.stdout
