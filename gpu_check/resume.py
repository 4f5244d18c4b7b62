"""Part (f) of the GPU check: a save and a resume change nothing. The PPO iteration of part (b) (at its first
length, the shape's width and vocabulary with `plan.resume_layers` layers: the same code path, a tenth of the 1.5B
shape's ~46 GB of optimizer state to write and read) runs twice with a checkpoint between; the first trainer is
dropped (its memory back) and a second one resumes from that checkpoint (same layout) and runs the second iteration
again — weights, optimizer states, the sampler, the KL controller and the RNG states all come
back. Gate: every metric of the two second iterations bitwise equal (timings and throughput excepted), but the
gradient norms on CUDA: within `GRAD_NORM_RTOL` of each other.

Why the exception, and only it: both second iterations start from the same weights (the saved ones), so their
forward passes — the experience and every loss of the update's one mini-batch per role, computed before its step —
run the same kernels on the same inputs, which cuBLAS and the attention kernels do deterministically. Their
backward passes do not: Megatron's `VocabParallelEmbedding` adds its gradient rows with `F.embedding`'s atomic
scatter unless `deterministic_mode` is set, and the flash / memory-efficient SDPA backward accumulates dQ with atomic
adds; the fp32 sums then differ in the order of their terms, ~1e-6 relative per sum, and the norm over them stays
within 1e-4 (1e-3 is the bound). Making the backward bitwise instead — Megatron's `deterministic_mode`,
`torch.use_deterministic_algorithms(True)` with `CUBLAS_WORKSPACE_CONFIG=:4096:8` set before CUDA starts, and the
math SDPA kernel (flash has no deterministic backward) — would measure another program than the one training runs.
On the CPU (the dry run) every kernel is deterministic and the norms are held bitwise too."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

from gpu_check.plan import GIB, Plan, backoff_record, ppo_config, synthetic_rows
from gpu_check.sizing import START_S, Sized, build_s, iteration_flops, largest_fitting, shrinking

UNTIMED = ("perf/", "timing/")  # wall-clock metrics: never equal
BACKWARD = "/grad_norm"  # `{role}/grad_norm`, `{role}/grad_norm_max`: the one metric of the update's backward
GRAD_NORM_RTOL = 1e-3  # on CUDA (module docstring)
SEED = 0


def size(plan: Plan) -> Sized:
    """(f) on `plan.card`: (b)'s first length at `plan.resume_layers` layers, sized as (b); three iterations over two
    trainers, and the checkpoint (actor and critic: weights and optimizer states) written once and read once."""
    from megatron_ppo.planner import plan as planner

    def cost(shape) -> Sized:
        config = ppo_config(plan, shape)
        roles = planner.plan(config).roles
        saved = sum(roles[role].weights_gib + roles[role].optimizer_gib for role in ("actor", "critic"))
        return Sized(shape, 0.0, True, flops=3 * iteration_flops(config), disk_gb=2 * saved * GIB / 1e9,
                     fixed_s=START_S + 2 * build_s(config))  # fmt: skip

    base = plan.base_shape(plan.seq_lengths[0], layers=plan.resume_layers)
    return largest_fitting(plan.card, shrinking(base), lambda shape: planner.plan(ppo_config(plan, shape)).peak_gib,
                           cost)  # fmt: skip


def check_resume(plan, work: Path) -> dict[str, Any]:
    from megatron_ppo.parallel.distributed import seed_everything
    from megatron_ppo.train.ppo import PPOTrainer

    shape = size(plan).shape
    config = ppo_config(plan, shape, work / "resume")
    rows = synthetic_rows(plan, shape, seed=shape.seq + 2)
    seed_everything(SEED)  # each trainer starts as a new job of the run would (its random initial weights too)
    trainer = PPOTrainer(config, rows, pad_id=0)
    try:
        trainer.iteration()
        trainer.save(wait=True)  # published before the second trainer resumes from it
        straight = trainer.iteration()
        backoffs = [backoff_record(trainer)]
    finally:
        trainer.close()
    del trainer  # freed here, before the second one is built (nothing holds it: models/ and train/callbacks.py)
    seed_everything(SEED)
    resumed_trainer = PPOTrainer(config, rows, pad_id=0)
    try:
        resumed_from = resumed_trainer.resume()
        resumed = resumed_trainer.iteration()
        backoffs.append(backoff_record(resumed_trainer))
    finally:
        resumed_trainer.close()
        shutil.rmtree(work / "resume", ignore_errors=True)
    keys = sorted(key for key in straight if not key.startswith(UNTIMED))
    bounded = plan.device == "cuda"
    differing = {key: (straight[key], resumed.get(key)) for key in keys
                 if not _same(key, straight[key], resumed.get(key), bounded)}  # fmt: skip
    return {"resumed_from": str(resumed_from), "metrics_compared": len(keys), "differing": differing,
            "grad_norm_rtol": GRAD_NORM_RTOL if bounded else 0.0, "oom_backoff": backoffs, "shape": shape.describe(),
            "ok": resumed_from is not None and not differing and not any(b["retries"] for b in backoffs)}  # fmt: skip


def _same(key: str, straight: float, resumed: float | None, bounded: bool) -> bool:
    """Bitwise, or for a gradient norm on CUDA within `GRAD_NORM_RTOL`."""
    if straight == resumed:
        return True
    if not bounded or BACKWARD not in key or resumed is None:
        return False
    return math.isclose(straight, resumed, rel_tol=GRAD_NORM_RTOL)


def table_lines(f: dict[str, Any]) -> list[str]:
    if "metrics_compared" not in f:
        return [f"(f) save + resume, same layout        FAILED {f.get('error', '')[:300]}"]
    if f["ok"]:
        bound = f" (grad norms within {f['grad_norm_rtol']:g} relative)" if f.get("grad_norm_rtol") else ""
        return [f"(f) save + resume, same layout        ok  {f['metrics_compared']} metrics bitwise equal{bound}; "
                f"ran {f['shape']}"]  # fmt: skip
    shown = "; ".join(f"{key}: {a!r} vs {b!r}" for key, (a, b) in list(f["differing"].items())[:4])
    retries = sum(backoff["retries"] for backoff in f["oom_backoff"])
    shown += f"; out of memory, backed off {retries} time(s)" if retries else ""
    return [f"(f) save + resume, same layout        FAILED  resumed from {f['resumed_from']}; "
            f"{len(f['differing'])} of {f['metrics_compared']} differ: {shown}"]  # fmt: skip
