"""The GPU check's driver (`python -m gpu_check`): a part whose process hangs is killed at `--part-timeout` with
everything it started (its process group), reported with its reason and the end of its log, while the other parts
run and report; the exit status says a part failed. Parts of its own here, so the driver's rules are tested in
seconds (the check's real parts run in tests/e2e/test_gpu_check_dry_run.py)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import psutil

from gpu_check import __main__ as driver
from gpu_check.parts import Part
from gpu_check.plan import DRY


def _passes(plan, work: Path) -> dict:
    return {"ok": True, "answer": 42}


def _hangs(plan, work: Path) -> dict:
    """Starts a child in a session of its own (as torchrun starts its workers), says so in its log, then never
    returns."""
    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    (work / "child.pid").write_text(str(child.pid))
    print("started the child; now waiting", flush=True)
    time.sleep(600)
    return {"ok": True}


def _table(result: dict) -> list[str]:
    return [f"part line ok={result.get('ok')}"]


def test_a_hung_part_is_killed_with_its_children_and_reported_while_the_others_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(driver, "PRELOAD", [__name__])  # what these parts need; not megatron-core
    parts = [Part("hang", "h", _hangs, _table, distributed=False),
             Part("quick", "q", _passes, _table, distributed=False)]  # fmt: skip
    out = tmp_path / "gpu_check.json"
    status = driver.Check(DRY, parts, out, tmp_path / "work", jobs=2, part_timeout=5).run()
    printed = capsys.readouterr()
    assert status == 1
    results = json.loads(out.read_text())["parts"]
    assert results["quick"] == {"ok": True, "answer": 42, "wall_s": results["quick"]["wall_s"]}
    hung = results["hang"]
    assert hung["ok"] is False and hung["error"] == "killed after 5 s (--part-timeout)", hung
    assert "started the child; now waiting" in hung["log_tail"], hung
    child = int((tmp_path / "work" / "hang" / "child.pid").read_text())
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, (
        "the hung part's child (a session of its own, as torchrun's workers) outlived it"
    )
    assert "part line ok=True" in printed.out and "part line ok=False" in printed.out
    assert "GPU check FAILED: hang" in printed.out and "--- hang failed; the end of its log:" in printed.err
