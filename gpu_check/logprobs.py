"""Part (c) of the GPU check: log-probs of the same weights (a dist checkpoint, so TE and local specs read it alike)
in the plan's dtype on this device and in fp32 on the CPU (a subprocess with the GPUs hidden); the difference of
per-token log-probs must stay within bf16 rounding.

    python -m gpu_check.logprobs --work DIR --shape real|dry     # the CPU side, run by the part itself
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.ports import free_port
from gpu_check.plan import PLANS, REPO, Plan, logprob_model_config, ppo_config, subprocess_env
from gpu_check.sizing import START_S, PartShape, Sized

ROWS, TOKENS = 2, 512
CPU_SIDE_S = 25.0  # the CPU's fp32 forward in a process of its own, imports included


def size(plan: Plan) -> Sized:
    """(c)'s model on `plan.card`: its weights and one forward of `ROWS` × `TOKENS` (the planner's reference role),
    the planner's reservation; a fixed shape, and a CPU forward in a second process."""
    from megatron_ppo.planner import plan as planner

    shape = PartShape(rows=ROWS, seq=TOKENS, micro_batch=ROWS, layers=plan.shape.layers_c)
    ref = planner.plan_role(ppo_config(plan, shape), "ref")
    gib = ref.weights_gib + ref.activations_gib + planner.RESERVED_GIB
    return Sized(shape, gib, gib <= plan.card.budget_gib, fixed_s=START_S + CPU_SIDE_S)


def logprobs_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    from megatron_ppo.models import run_micro_batches, vocab_parallel_log_probs

    labels = torch.roll(input_ids, -1, dims=1)

    def fn(batch, logits):
        return torch.zeros(()), {"lp": vocab_parallel_log_probs(logits, batch["labels"])[0].float().cpu()}

    (out,) = run_micro_batches(model, [{"input_ids": input_ids, "labels": labels}], fn, forward_only=True)
    return out["lp"][:, :-1]


def check_logprobs(plan: Plan, work: Path) -> dict[str, Any]:
    from megatron_ppo.checkpoint import store
    from megatron_ppo.config.schema import MegatronConfig
    from megatron_ppo.models import build_role_model

    model = build_role_model("actor", logprob_model_config(plan, plan.dtype), MegatronConfig())
    root = work / "logprob_weights"
    store.save_checkpoint(root, 0, {"actor": model}, {}, {"step": 0})
    input_ids = torch.randint(1, plan.shape.vocab, (ROWS, TOKENS), generator=torch.Generator().manual_seed(1))
    torch.save(input_ids, work / "logprob_input.pt")
    device_lp = logprobs_of(model, input_ids)
    del model
    command = [sys.executable, "-m", "gpu_check.logprobs", "--work", str(work), "--shape", plan.name]
    env = subprocess_env(CUDA_VISIBLE_DEVICES="", MASTER_PORT=str(free_port()))
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"CPU fp32 subprocess exit {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}")
    cpu_lp = torch.load(work / "logprob_cpu.pt")
    # relative to the log-prob (≈ −log V for a fresh model), in units of bf16's precision 2⁻⁸: bf16 activations
    # and logits carry that rounding through every layer. Measured on CPU (bf16 vs fp32, this 4-layer shape):
    # mean 0.004 ≈ 1 ulp, max 0.02, correlation 0.9995; on an H200 (first run): mean 3.6e-3.
    relative = (device_lp - cpu_lp).abs() / cpu_lp.abs().clamp(min=1.0)
    correlation = float(torch.corrcoef(torch.stack([device_lp.flatten(), cpu_lp.flatten()]))[0, 1])
    ulp = 2.0**-8 if plan.dtype != "fp32" else 2.0**-23
    tolerance = {"mean_relative": 2 * ulp, "max_relative": 16 * ulp, "correlation": 0.999 if ulp > 1e-6 else 0.999999}
    out = {"mean_relative_diff": float(relative.mean()), "max_relative_diff": float(relative.max()),
           "mean_abs_diff": float((device_lp - cpu_lp).abs().mean()), "correlation": correlation,
           "tolerance": tolerance, "logprob_mean": float(cpu_lp.mean()), "logprob_std": float(cpu_lp.std()),
           "tokens": relative.numel(), "dtype": plan.dtype}  # fmt: skip
    out["ok"] = (
        out["mean_relative_diff"] <= tolerance["mean_relative"]
        and out["max_relative_diff"] <= tolerance["max_relative"]
        and correlation >= tolerance["correlation"]
    )
    return out


def cpu_logprobs(work: Path, plan: Plan) -> None:
    """The CPU side, in its own process: the saved weights in fp32, log-probs of the saved input."""
    from megatron_ppo.checkpoint import store
    from megatron_ppo.config.schema import MegatronConfig
    from megatron_ppo.models import build_role_model
    from megatron_ppo.parallel import destroy_distributed, init_distributed

    init_distributed(MegatronConfig(), seed=0, device="cpu")
    model = build_role_model("actor", logprob_model_config(plan, "fp32"), MegatronConfig())
    store.load_weights(model, work / "logprob_weights", "actor")
    torch.save(logprobs_of(model, torch.load(work / "logprob_input.pt")), work / "logprob_cpu.pt")
    destroy_distributed()


def table_lines(c: dict[str, Any]) -> list[str]:
    if "mean_relative_diff" not in c:
        return [f"(c) log-probs vs CPU fp32             FAILED {c.get('error', '')[:300]}"]
    tol = c["tolerance"]
    return [f"(c) log-probs {c['dtype']} vs CPU fp32        {'ok' if c['ok'] else 'FAILED'}  relative |Δ| mean "
            f"{c['mean_relative_diff']:.1e} (≤ {tol['mean_relative']:.1e}), max {c['max_relative_diff']:.1e} (≤ "
            f"{tol['max_relative']:.1e}); correlation {c['correlation']:.5f} (≥ {tol['correlation']}); mean |Δ| "
            f"{c['mean_abs_diff']:.3f} nats"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the CPU fp32 side of the GPU check's part (c)")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(PLANS), required=True)
    args = parser.parse_args(argv)
    cpu_logprobs(args.work, PLANS[args.shape])
    return 0


if __name__ == "__main__":
    sys.exit(main())
