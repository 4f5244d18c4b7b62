"""Part (h) of the GPU check, with two or more GPUs visible: the parallel layouts compute what one GPU computes.

1. **Layout parity.** The (b)-shaped model (the dry run: its tiny shape) starts from one set of weights: actor and
   critic built at TP=1 (the value head given random weights, so values test something) and saved as a dist
   checkpoint, which every layout loads as `model.init_checkpoint` / `critic.model.init_checkpoint`, resharded by
   Megatron. At TP=1 (in this process), TP=2 with sequence parallelism and PP=2 (both in one 2-process torchrun
   launch, re-laid out between them), a `PPOTrainer` on the same rows (one token short of the (b) length, so the
   width is odd and sequence parallelism pads it and cuts it back) computes the experience of a fixed batch
   (`forward_passes`: actor and reference log-probs, critic values) and runs one iteration (one critic and one
   actor update), then saves its weights. Compared with TP=1 (`compare`):
   - experience, over response tokens: relative |Δ| = |x − x₁| / max(|x₁|, 1), its mean and its maximum;
   - update: `actor/pg_loss`, `actor/entropy`, `actor/grad_norm`, `critic/vf_loss`, `critic/grad_norm`:
     |x − x₁| ≤ max(rel · |x₁|, abs);
   - weights after the step, loaded back at TP=1: ‖w − w₁‖ / ‖w₁‖ over each role's parameters.
2. **The tiny recipe at TP=2 with sequence parallelism** through the CLI on 2 GPUs (torchrun, 2 processes; the
   shortened recipe of (a)): exit 0 and held-out accuracy rises. The dry run trains it on a shrunk task, as (a).

Tolerances (`TOLERANCES`, by the dtype the models run in). bf16 (a real run): TP and PP change the order of the
row-parallel all-reduce sums and of the pipeline's gradient sums, and bf16 rounds each (2⁻⁸ relative). Megatron-LM's
own TP-vs-DP test (`tests/unit_tests/transformer/test_tp_vs_dp_equivalence.py`, 28 layers, bf16, H100) measures a
hidden-state difference of 0.03 after the first layer growing to 0.11 after the 28th, and allows 0.15 absolute (fp32:
1e-3). The log-probs here take (c)'s bounds for bf16 rounding through the whole model — 2 bf16 ulps (2⁻⁷) on
average, 16 (2⁻⁴) at worst; the values, a projection of the last hidden states by a head of unit expected norm
(std 1/√hidden), differ as those do: 2e-2 on average (4× Megatron's mean), 0.15 at worst (its bound); the update's
scalars, means over every response token, 2e-2 relative (1e-3 absolute:
`actor/pg_loss` of whitened advantages at ratio 1 is ≈ 0); the weights one bf16 ulp (2⁻⁸) of their norm. At the
trainer's learning rate (1e-6) Adam's first step is far below the bf16 rounding of the weights, so in bf16 the
weights' gate checks the resharded load, save and rounding, and the update itself is gated by its loss and grad
norm. fp32 (the dry run on the CPU): the layout-parity tests' bounds (`tests/distributed`: 1e-5 on log-probs and
values, here relative to max(|x₁|, 1); 1e-4 relative on metrics), weights 1e-6 of their norm — there TP=1's step
moves the weights by 1.8e-5 (actor) and 1.6e-4 (critic) of their norm, so a wrong update fails it (measured in the
dry run: the layouts differ from TP=1 by ≤ 3e-7 in the experience and ≤ 5e-9 in the weights; with the
sequence-parallel norm's gradients left unreduced over TP, TP2 + SP fails on the critic's grad norm and weights).
The bf16 bounds, run once on the CPU at the tiny shape (2 layers, bf16): TP2 + SP differs from TP=1 by 5.9e-5 mean
and 3.3e-4 max on the log-probs, 2.3e-3 and 8.0e-3 on the values, ≤ 4.2e-4 relative on the grad norms; PP2 not at
all. Unmeasured on GPUs: no two GPUs have been lent to this project yet.

With fewer than two GPUs the driver reports the part `skipped` without starting it (`Part.gpus`): the check stays
runnable on one GPU.
Run by `python -m gpu_check` as part (h) (its two checks in a process each); `python -m gpu_check.layouts` is the
2-process side.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gpu_check.card import Card
from gpu_check.plan import PLANS, REPO, Plan, ppo_config, subprocess_env, synthetic_rows, tiny_recipe
from gpu_check.sizing import START_S, Sized, build_s, iteration_flops, largest_fitting, shrinking
from megatron_ppo.config.schema import MegatronConfig

PROCESSES = 2
LAYOUTS = {  # name → layout on PROCESSES processes; "tp1", the reference, runs in the check's own process
    "tp2-sp": MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": MegatronConfig(pipeline_model_parallel_size=2),
}
REFERENCE = "tp1"
PASSES = ("old_log_prob", "ref_log_prob", "values")
UPDATE_METRICS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")
ROLES = ("actor", "critic")  # the trained roles, whose weights the step changes
SEED = 0


@dataclass(frozen=True)
class Tolerance:
    """The gates of one dtype: the experience's mean and max relative |Δ| (log-probs; values), update metrics
    |Δ| ≤ max(rel·|x₁|, abs), and each role's ‖w − w₁‖ / ‖w₁‖ after the step."""

    log_prob_mean: float
    log_prob_max: float
    value_mean: float
    value_max: float
    metric_rel: float
    metric_abs: float
    weights: float

    def experience(self, key: str) -> tuple[float, float]:
        """(mean, max) bounds of the experience tensor `key` (one of `PASSES`)."""
        return (self.value_mean, self.value_max) if key == "values" else (self.log_prob_mean, self.log_prob_max)


TOLERANCES = {
    "bf16": Tolerance(log_prob_mean=2**-7, log_prob_max=2**-4, value_mean=2e-2, value_max=0.15, metric_rel=2e-2,
                      metric_abs=1e-3, weights=2**-8),
    "fp32": Tolerance(log_prob_mean=1e-5, log_prob_max=1e-5, value_mean=1e-5, value_max=1e-5, metric_rel=1e-4,
                      metric_abs=1e-6, weights=1e-6),
}  # fmt: skip


def dtype_of(plan: Plan) -> str:
    """The dtype the layouts run in: the plan's on the GPU, fp32 in the dry run (the CPU's parity is exact enough
    to gate the code itself)."""
    return "fp32" if plan.device == "cpu" else plan.dtype


# --- the comparison --------------------------------------------------------------------------------------------
def relative_differences(ours: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) over the tokens where `mask` ([rows, T], response tokens) is set of |x − x₁| / max(|x₁|, 1)."""
    selected = mask.bool()
    ours, reference = ours.double()[selected], reference.double()[selected]
    relative = (ours - reference).abs() / reference.abs().clamp(min=1.0)
    return float(relative.mean()), float(relative.max())


def weight_difference(ours: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> float:
    """‖w − w₁‖ / ‖w₁‖ over every tensor of `reference` (the same names in `ours`, both at TP=1)."""
    if set(ours) != set(reference):
        raise KeyError(f"the weights hold other tensors: {sorted(set(ours) ^ set(reference))[:8]}")
    squared = sum(float((ours[k].double() - v.double()).square().sum()) for k, v in reference.items())
    norm = sum(float(v.double().square().sum()) for v in reference.values())
    return math.sqrt(squared / norm)


def compare(
    reference: Mapping[str, Any], ours: Mapping[str, Any], weights: Mapping[str, float], tolerance: Tolerance
) -> dict[str, Any]:
    """One layout's run (`ours`) against TP=1's (`reference`), each {"passes": {key: [rows, T]}, "mask": [rows, T],
    "metrics": {key: float}}, and its `weights` ({role: ‖w − w₁‖ / ‖w₁‖}): every difference and its verdict, and
    `failures`, one line per difference beyond `tolerance`."""
    failures: list[str] = []
    passes = {}
    for key in PASSES:
        mean, largest = relative_differences(ours["passes"][key], reference["passes"][key], reference["mask"])
        passes[key] = {"mean": mean, "max": largest}
        mean_bound, max_bound = tolerance.experience(key)
        if not (mean <= mean_bound and largest <= max_bound):  # a NaN fails too
            failures.append(f"{key}: relative |Δ| mean {mean:.1e}, max {largest:.1e}")
    metrics = {}
    for key in UPDATE_METRICS:
        value, expected = ours["metrics"][key], reference["metrics"][key]
        metrics[key] = (value, expected)
        if not abs(value - expected) <= max(tolerance.metric_rel * abs(expected), tolerance.metric_abs):
            failures.append(f"{key}: {value:.6g} vs {expected:.6g}")
    for role, difference in weights.items():
        if not difference <= tolerance.weights:
            failures.append(f"{role} weights: ‖Δw‖/‖w‖ {difference:.1e}")
    return {"passes": passes, "metrics": metrics, "weights": dict(weights), "failures": failures, "ok": not failures}


# --- one layout's run (this process, or each rank of the 2-process launch) ---------------------------------------
def size(plan: Plan) -> Sized:
    """(h) on `plan.card` (each of the two GPUs): its TP=1 reference, the largest trainer of all the layouts, sized
    as (b)'s first length with padded rows; the 2-process side sizes with the same card (`--card`)."""
    from megatron_ppo.planner import plan as planner

    def cost(shape) -> Sized:
        config = ppo_config(plan, shape)
        return Sized(shape, 0.0, True, flops=3 * iteration_flops(config), fixed_s=2 * START_S + 3 * build_s(config))

    return largest_fitting(plan.card, shrinking(plan.base_shape(plan.seq_lengths[0])),
                           lambda shape: planner.plan(ppo_config(plan, shape)).peak_gib, cost)  # fmt: skip


def layout_model(plan: Plan, work: Path):
    """(b)'s model in the layouts' dtype."""
    return dataclasses.replace(ppo_config(plan, size(plan).shape, work).model, params_dtype=dtype_of(plan))


def layout_config(plan: Plan, name: str, layout: MegatronConfig, work: Path):
    """(b)'s PPO config at its first length, every role at `layout` on a node of as many GPUs as the layout's
    model-parallel size (DP=1), in the layouts' dtype, from the initial weights under `work`; validated again."""
    from megatron_ppo.config.frozen import with_changes
    from megatron_ppo.config.validate import validate

    initial = str(work / "initial")
    model = dataclasses.replace(layout_model(plan, work), init_checkpoint=initial)
    changes = {f"{role}.megatron": layout for role in ("actor", "ref", "critic")}
    gpus = layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size
    changes |= {"model": model, "critic.model.init_checkpoint": initial, "cluster.gpus_per_node": gpus}
    config = with_changes(ppo_config(plan, size(plan).shape, work / name), changes)
    problems = validate(config)
    if problems:
        raise RuntimeError(f"the {name} layout's config is invalid: {problems}")
    return config


def layout_rows(plan: Plan) -> list:
    """(b)'s synthetic rows one token short of its first length: an odd width, which sequence parallelism pads."""
    shape = size(plan).shape
    return synthetic_rows(plan, dataclasses.replace(shape, seq=shape.seq - 1), seed=7)


def save_initial_weights(plan: Plan, work: Path) -> None:
    """Actor and critic at TP=1, the critic's zero value head drawn at random (std 1/√hidden), saved under
    `work/initial` for every layout to start from."""
    from megatron_ppo.checkpoint import store
    from megatron_ppo.models import build_role_model, unwrap
    from megatron_ppo.parallel.distributed import seed_everything

    model = layout_model(plan, work)
    seed_everything(SEED)
    actor = build_role_model("actor", model, MegatronConfig())
    critic = build_role_model("critic", model, MegatronConfig())
    head = unwrap(critic.chunks[-1]).output_layer.weight
    with torch.no_grad():
        head.normal_(0.0, model.hidden_size**-0.5, generator=torch.Generator(head.device).manual_seed(SEED))
    store.save_checkpoint(work / "initial", 0, {"actor": actor, "critic": critic}, {}, {"step": 0})


def run_layout(plan: Plan, name: str, layout: MegatronConfig, work: Path) -> None:
    """The experience of the first `plan.rows` rows and one PPO iteration at `layout` (the process groups must hold
    it); rank 0 saves {"passes", "mask", "metrics"} to `work/<name>.pt`, every rank its shard of the weights after
    the step to `work/<name>/weights`."""
    from megatron_ppo.checkpoint import store
    from megatron_ppo.parallel.collectives import global_rank
    from megatron_ppo.parallel.device import current_device, to_device
    from megatron_ppo.train.batch import collate
    from megatron_ppo.train.experience import forward_passes
    from megatron_ppo.train.ppo import PPOTrainer

    config = layout_config(plan, name, layout, work)
    rows = layout_rows(plan)
    trainer = PPOTrainer(config, rows, pad_id=0)
    try:
        batch = to_device(collate(rows[: plan.rows], pad_id=0), current_device(), "the layout check's batch")
        passes = forward_passes(config, batch, trainer.actor, trainer.ref, trainer.critic)
        metrics = trainer.iteration()
        models = {"actor": trainer.actor, "critic": trainer.critic}
        store.save_checkpoint(work / name / "weights", 1, models, {}, {"step": 1})
    finally:
        trainer.close()
    if global_rank() == 0:
        torch.save({"passes": {key: passes[key].float().cpu() for key in PASSES}, "mask": batch["loss_mask"].cpu(),
                    "metrics": {key: float(metrics[key]) for key in UPDATE_METRICS}}, work / f"{name}.pt")  # fmt: skip


def layouts_main(work: Path, shape: str, card: Card) -> None:
    """The 2-process side: every layout of `LAYOUTS` in turn, one process group re-laid out between them, sized to
    `card` as the check's own process sized its reference."""
    from megatron_ppo.parallel import destroy_distributed, init_distributed

    plan = dataclasses.replace(PLANS[shape], card=card)
    for name, layout in LAYOUTS.items():
        init_distributed(layout, seed=SEED, device=plan.device)
        run_layout(plan, name, layout, work)
    destroy_distributed()


def weights_reader(plan: Plan, work: Path) -> Callable[[Path], dict[str, dict[str, torch.Tensor]]]:
    """A function that loads the actor and critic weights of a checkpoint (any layout) at TP=1 in this process:
    {role: {key: tensor}} (copies; the models are built once)."""
    from megatron_ppo.checkpoint import store
    from megatron_ppo.models import build_role_model, unwrap

    models = {role: build_role_model(role, layout_model(plan, work), MegatronConfig()) for role in ROLES}

    def read(path: Path) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for role, role_model in models.items():
            store.load_weights(role_model, path, role)
            out[role] = {
                f"{index}.{key}": value.detach().clone()
                for index, chunk in enumerate(role_model.chunks)
                for key, value in unwrap(chunk).state_dict().items()
                if isinstance(value, torch.Tensor)
            }
        return out

    return read


# --- the part --------------------------------------------------------------------------------------------------
def check_layouts(plan: Plan, work: Path) -> dict[str, Any]:
    """(h) 1: TP=2 + SP and PP=2 against TP=1 (the process groups of this process must be TP=1 on one rank)."""
    from megatron_ppo.parallel.distributed import seed_everything

    work = work / "layouts"
    tolerance = TOLERANCES[dtype_of(plan)]
    save_initial_weights(plan, work)
    seed_everything(SEED)
    run_layout(plan, REFERENCE, MegatronConfig(), work)
    read = weights_reader(plan, work)
    reference_weights = read(work / REFERENCE / "weights")
    step = {role: weight_difference(initial, reference_weights[role])  # TP=1's step: does the gate resolve it?
            for role, initial in read(work / "initial").items()}  # fmt: skip
    shutil.rmtree(work / REFERENCE)  # each checkpoint deleted once read: the real run's hold ~6 GB each
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the launched ranks use this GPU too
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={PROCESSES}",
               "--standalone", "-m", "gpu_check.layouts", "--work", str(work),
               "--shape", plan.name, "--card", json.dumps(asdict(plan.card))]  # fmt: skip
    started = time.perf_counter()
    result = subprocess.run(command, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, check=False)
    launch_s = time.perf_counter() - started
    shutil.rmtree(work / "initial")
    if result.returncode != 0:
        raise RuntimeError(
            f"the layouts' launch exited {result.returncode}:\n{(result.stdout + result.stderr)[-3000:]}"
        )
    reference = torch.load(work / f"{REFERENCE}.pt")
    layouts = {}
    for name in LAYOUTS:
        weights = read(work / name / "weights")
        shutil.rmtree(work / name)
        differences = {role: weight_difference(weights[role], reference_weights[role]) for role in ROLES}
        layouts[name] = compare(reference, torch.load(work / f"{name}.pt"), differences, tolerance)
    return {"dtype": dtype_of(plan), "tolerance": asdict(tolerance), "reference_step": step, "layouts": layouts,
            "launch_s": launch_s, "ok": all(layout["ok"] for layout in layouts.values())}  # fmt: skip


def check_tiny_recipe_tp2_sp(plan: Plan, work: Path) -> dict[str, Any]:
    """(h) 2: the tiny recipe at TP=2 with sequence parallelism through the CLI on 2 GPUs."""
    return tiny_recipe(plan, work, "tiny_tp2_sp", tensor_parallel=PROCESSES, sequence_parallel=True)


def layouts_table_lines(layouts: dict[str, Any]) -> list[str]:
    lines = []
    if "skipped" in layouts:
        lines.append(f"(h) TP2 + SP and PP2 against TP1     skipped: {layouts['skipped']} (needs {PROCESSES})")
    elif "layouts" not in layouts:
        lines.append(f"(h) TP2 + SP and PP2 against TP1     FAILED {layouts.get('error', '')[:300]}")
    else:
        tol = layouts["tolerance"]
        step = ", ".join(f"{role} {size:.1e}" for role, size in layouts["reference_step"].items())
        lines.append(f"(h) TP2 + SP and PP2 against TP1 ({layouts['dtype']}): experience relative |Δ| mean/max ≤ "
                     f"{tol['log_prob_mean']:.1e}/{tol['log_prob_max']:.1e} (log-probs), {tol['value_mean']:.1e}/"
                     f"{tol['value_max']:.1e} (values); update metrics ≤ max({tol['metric_rel']:.0e} rel, "
                     f"{tol['metric_abs']:.0e}); weights ‖Δw‖/‖w‖ ≤ {tol['weights']:.1e} (TP1's step: "
                     f"{step})")  # fmt: skip
        for name, layout in layouts["layouts"].items():
            worst = max(layout["passes"].values(), key=lambda d: d["max"])
            norms = ", ".join(
                f"{key.replace('/grad_norm', '')} {ours:.5g}/{ref:.5g}"
                for key, (ours, ref) in layout["metrics"].items()
                if key.endswith("grad_norm")
            )
            weights = ", ".join(f"{role} {diff:.1e}" for role, diff in layout["weights"].items())
            verdict = "ok" if layout["ok"] else f"FAILED {'; '.join(layout['failures'])[:300]}"
            lines.append(f"    {name:<8} {verdict}  experience |Δ| max {worst['max']:.1e}; grad norm (ours/TP1) "
                         f"{norms}; weights {weights}")  # fmt: skip
    return lines


def recipe_table_lines(recipe: dict[str, Any]) -> list[str]:
    lines = []
    if "skipped" in recipe:
        lines.append(f"(h) tiny recipe TP2 + SP via the CLI skipped: {recipe['skipped']} (needs {PROCESSES})")
    elif "exit_code" not in recipe:
        lines.append(f"(h) tiny recipe TP2 + SP via the CLI FAILED {recipe.get('error', '')[:300]}")
    else:
        verdict = "ok" if recipe["ok"] else "FAILED"
        detail = (f"accuracy {recipe['accuracy_before']:.3f} → {recipe['accuracy_after']:.3f}"
                  if "accuracy_after" in recipe else "overrides validated (dry run)")  # fmt: skip
        lines.append(f"(h) tiny recipe TP2 + SP via the CLI {verdict}  {detail}  ({recipe['wall_s']:.0f} s)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the 2-process side of the GPU check's part (h)")
    parser.add_argument("--work", type=Path, required=True, help="the part's folder (initial weights, results)")
    parser.add_argument("--shape", choices=("real", "dry"), required=True)
    parser.add_argument("--card", required=True, help="the card the check sized its parts to, as JSON")
    args = parser.parse_args(argv)
    layouts_main(args.work, args.shape, Card(**json.loads(args.card)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
