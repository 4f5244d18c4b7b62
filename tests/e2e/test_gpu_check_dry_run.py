"""`make gpu-check DRY_RUN=1`: the GPU check's every part, each in its own process, on the CPU with a tiny model
(part (h)'s layouts on 2 gloo processes), so the check cannot rot; its results stream as each part ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PARTS = ["j", "b32", "b64", "a", "c", "d", "e", "f", "g", "i", "h", "h_recipe"]


def test_gpu_check_dry_run_runs_every_part_in_its_own_process_and_streams_its_table(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-m", "gpu_check", "--dry-run", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    report = json.loads(out.read_text())
    parts = report["parts"]
    assert sorted(parts) == sorted(PARTS) and all(part["ok"] for part in parts.values()), parts
    # streamed: each part's lines were printed when it ended, in the order the parts ended, before the summary
    ends = [result.stdout.index(f"({key}: ") for key in PARTS]
    assert max(ends) < result.stdout.index("GPU check passed"), result.stdout
    assert result.stdout.index("(b) PPO iteration") < result.stdout.index("(b64: "), "(b)'s line comes as it ends"
    # (a) and (h)'s recipe trained through the CLI (the CUDA width bucket forced), not only validated
    for recipe in (parts["a"], parts["h_recipe"]):
        assert recipe["exit_code"] == 0 and "accuracy_after" in recipe and recipe["accuracy_judged"] is False, recipe
    assert parts["f"]["metrics_compared"] > 10 and parts["f"]["grad_norm_rtol"] == 0.0, "bitwise on CPU"
    assert parts["g"]["alive_after_drop"] == 0, "the dropped trainer is freed without the collector"
    assert parts["g"]["attention_kernel"] == "flash" and parts["g"]["bounds"]["ppo_kl"] == 1e-6, parts["g"]
    # every part sized to the card (the CPU stand-in here) before it started, and ran the shape it planned
    assert set(report["plan"]["sized"]) == set(PARTS) and report["plan"]["left_out"] == []
    assert result.stdout.index("card a CPU process") < result.stdout.index("… j started")
    assert parts["b32"]["shape"] == report["plan"]["sized"]["b32"]["shape"].split(";")[0], parts["b32"]
    assert all(part["oom_backoff"]["retries"] == 0 for part in (parts["b32"], parts["b64"], parts["g"]))
    offload = parts["d"]
    assert set(offload["on"]["resident_gib"]) == set(offload["off"]["resident_gib"]) == {
        "experience", "critic update", "actor update", "between iterations"}  # fmt: skip
    assert offload["on"]["resident_gib"]["actor update"] < offload["off"]["resident_gib"]["actor update"]
    assert offload["on"]["planned_peak_gib"] < offload["off"]["planned_peak_gib"]
    iterations = [parts["b32"], parts["b64"]]
    # the same tokens at each length: 8 rows × 32, 4 rows × 64 (a multiple of the micro-batch)
    assert [(b["rows"], b["seq"]) for b in iterations] == [(8, 32), (4, 64)]
    assert all(b["mfu_iteration"] > 0 and b["iteration_over_bare"] > 0 for b in iterations), iterations
    # (b) ran packed (THD) in every pass of every role, rows of one length: nothing computed but the real tokens
    for b in iterations:
        assert b["computed_over_real"] == 1.0, b
        assert {note.split(":")[0] for note in b["pass_notes"] if "packed sequences" in note} == {
            "actor passes", "ref passes", "critic passes"}, b["pass_notes"]  # fmt: skip
        assert {"perf/mfu/actor", "perf/mfu/critic"} <= set(b["perf"]), b["perf"]
    assert parts["b32"]["padded_iteration_s"] > 0 and parts["b32"]["padded_computed_over_real"] == 1.0
    assert "sequences packed (THD" in report["kernels"] and "scaled_dot_product_attention" in report["kernels"]
    assert "(c) log-probs bf16 vs CPU fp32" in result.stdout and "(d) host offload" in result.stdout
    # (h) on 2 CPU processes (gloo): TP2 + SP and PP2 ran and were compared with TP1 in fp32, not skipped
    layouts = parts["h"]
    assert layouts["dtype"] == "fp32" and set(layouts["layouts"]) == {"tp2-sp", "pp2"}, layouts
    assert all(step > 10 * layouts["tolerance"]["weights"] for step in layouts["reference_step"].values()), layouts
    assert parts["h_recipe"]["processes"] == 2, "the TP2 + SP recipe ran on 2 processes"
    assert "(h) TP2 + SP and PP2 against TP1 (fp32)" in result.stdout
