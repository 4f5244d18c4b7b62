"""Part (f) of the GPU check: a save and a resume change nothing. The PPO iteration of part (b) (at its first
length) runs twice with a checkpoint between; a second trainer resumes from that checkpoint (same layout) and runs
the second iteration again. Gate: every metric of the two second iterations bitwise equal (timings and
throughput excepted) — weights, optimizer states, the sampler, the KL controller and the RNG states all come back."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from bench.gpu_plan import ppo_config, synthetic_rows

UNTIMED = ("perf/", "timing/")  # wall-clock metrics: never equal
SEED = 0


def check_resume(plan, work: Path) -> dict[str, Any]:
    from megatron_ppo.parallel.distributed import seed_everything
    from megatron_ppo.train.ppo import PPOTrainer

    seq = plan.seq_lengths[0]
    config = ppo_config(plan, seq, work / "resume")
    rows = synthetic_rows(plan, seq, seed=seq + 2)
    seed_everything(SEED)  # each trainer starts as a new job of the run would (its random initial weights too)
    trainer = PPOTrainer(config, rows, pad_id=0)
    try:
        trainer.iteration()
        trainer.save()
        straight = trainer.iteration()
    finally:
        trainer.close()
    seed_everything(SEED)
    resumed_trainer = PPOTrainer(config, rows, pad_id=0)
    try:
        resumed_from = resumed_trainer.resume()
        resumed = resumed_trainer.iteration()
    finally:
        resumed_trainer.close()
        shutil.rmtree(work / "resume", ignore_errors=True)  # its checkpoint: ~40 GB at the 1.5B shape
    keys = sorted(key for key in straight if not key.startswith(UNTIMED))
    differing = {key: (straight[key], resumed.get(key)) for key in keys if straight[key] != resumed.get(key)}
    return {"resumed_from": str(resumed_from), "metrics_compared": len(keys), "differing": differing,
            "ok": resumed_from is not None and not differing}  # fmt: skip


def table_lines(f: dict[str, Any]) -> list[str]:
    if "metrics_compared" not in f:
        return [f"(f) save + resume, same layout        FAILED {f.get('error', '')[:300]}"]
    if f["ok"]:
        return [f"(f) save + resume, same layout        ok  {f['metrics_compared']} metrics bitwise equal"]
    shown = "; ".join(f"{key}: {a!r} vs {b!r}" for key, (a, b) in list(f["differing"].items())[:4])
    return [f"(f) save + resume, same layout        FAILED  resumed from {f['resumed_from']}; "
            f"{len(f['differing'])} of {f['metrics_compared']} differ: {shown}"]  # fmt: skip
