"""`compare-kl`: the tiny recipe's PPO run with the KL term off, fixed, adaptive, staged under the power law and
staged under the PI rule, side by side: held-out accuracy and how closely each run's KL followed the recipe's stage
targets (`kl_tracking`: the share of steps within ±10 %, judged after each stage's first two steps).

The project's central claim — KL regularisation keeps offline PPO from degrading — measured on the user's own
machine: same SFT start, same offline data, same seed; only the KL control differs. Each invocation writes into a
directory of its own, `<parent of trainer.default_local_dir>/compare-kl/<UTC time>-<hex>/<variant>/`, so a second
comparison (another seed, other overrides) never meets the first one's checkpoints; the table names what it read.
"""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from megatron_ppo.algo import StagedKLSchedule
from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.checkpoint.run_identity import new_run_id
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.parallel.collectives import broadcast_from_rank0
from megatron_ppo.runs.report import table_console
from megatron_ppo.tasks.addition.recipe import prepare_addition_task, train_on_task
from megatron_ppo.train.kl_coefficients import (
    KLTracking,
    build_kl_coefficients,
    kl_tracking,
    logged_kl,
    tracked_kl_prefix,
)
from megatron_ppo.train.metrics import is_logging_rank

# variant → the stage rule it swaps into the recipe's stages (None: the recipe's own stages are not used)
STAGED = {"staged-power-law": "power_law", "staged-pi": "pi"}
VARIANTS = ("off", "fixed", "adaptive", *STAGED)


def comparison_directory(config: PPOConfig, invocation: str) -> Path:
    """Where one invocation's variants write: `invocation` is its own key (a time-ordered id)."""
    return Path(config.trainer.default_local_dir).parent / "compare-kl" / invocation


def variants(config: PPOConfig, invocation: str) -> dict[str, PPOConfig]:
    """off: no KL term; fixed: the recipe's start coefficient held; adaptive: Ziegler toward the late-stage target;
    staged-power-law and staged-pi: the recipe's stages with every target stage under that rule (its warm-up kept).
    Each a new run in `comparison_directory(config, invocation) / <variant>`."""
    stages = config.algorithm.kl_ctrl.stages
    late_target = stages[-1].target_kl if stages and stages[-1].target_kl else config.algorithm.kl_ctrl.target_kl
    out = {}
    for name in VARIANTS:
        root = comparison_directory(config, invocation) / name
        changes = {"trainer.default_local_dir": str(root / "checkpoints"), "trainer.log_dir": str(root / "tensorboard"),
                   "trainer.resume_mode": "disable"}  # fmt: skip
        if name == "off":
            changes |= {"actor.use_kl_loss": False, "algorithm.use_kl_in_reward": False}
        if name in ("off", "fixed", "adaptive"):
            changes |= {"algorithm.kl_ctrl.type": "adaptive" if name == "adaptive" else "fixed",
                        "algorithm.kl_ctrl.stages": [], "algorithm.kl_ctrl.target_kl": late_target,
                        "algorithm.kl_ctrl.horizon": 1000.0}  # fmt: skip
        if name in STAGED:
            rule = STAGED[name]
            changes["algorithm.kl_ctrl.stages"] = [
                s if s.controller == "warmup" or s.target_kl is None else with_changes(s, {"controller": rule})
                for s in stages
            ]
        out[name] = with_changes(config, changes)
    return out


def compare_kl(
    config: PPOConfig, plot: str | None = None, weights: InitialWeights | None = None
) -> dict[str, dict[str, float]]:
    """Train every variant; print a table naming each run's TensorBoard folder, and return {variant: accuracy
    before and after, final KL and β, KL tracking of the recipe's stage targets}. `plot`: also draw the runs on one
    figure (`report --plot`) into that file, or "" for `<comparison directory>/compare-kl.png`. `weights`: the run's
    initial weights (`distributed_run`'s; the actor's is the task's SFT policy)."""
    if plot is not None:
        from megatron_ppo.runs.figure import matplotlib_figure

        matplotlib_figure()  # a missing extra is named before any training
    task = prepare_addition_task(config)
    invocation = broadcast_from_rank0(new_run_id())
    results, log_dirs, tracking, batch_tracking = {}, {}, {}, {}
    prefix = tracked_kl_prefix(config)  # every variant measures the recipe's KL: the probe's, else the batch's
    tracked = prefix + "mean"
    for name, variant in variants(config, invocation).items():
        trainer, history, before, after = train_on_task(variant, task, weights)
        kls = [h[tracked] for h in history if tracked in h]
        tracking[name] = recipe_tracking(config, trainer.total_steps, history, prefix)
        batch_tracking[name] = recipe_tracking(config, trainer.total_steps, history)
        results[name] = {"before": before["accuracy"], "after": after["accuracy"],
                         "kl_final": kls[-1] if kls else float("nan"),
                         "coef_final": history[-1].get("kl/coef", 0.0) if history else float("nan"),
                         "within": tracking[name].within, "mean_error": tracking[name].mean_error,
                         "max_ratio": tracking[name].max_ratio, "batch_within": batch_tracking[name].within,
                         "noise_ceiling": batch_tracking[name].noise_ceiling}  # fmt: skip
        log_dirs[name] = str(trainer.run.log_dir)
    if is_logging_rank():
        directory = comparison_directory(config, invocation)
        table = Table(
            title="held-out accuracy after offline PPO, by KL control (same SFT start, data and seed)",
            caption=f"runs of this comparison (TensorBoard runs named relative to it), read from {directory}",
        )
        columns = ("KL control", "SFT start", "after PPO", "change", f"{tracked} ±10 %", "kl/mean ±10 %",
                   "kl/mean: noise allows", "mean |KL/target − 1|", "max KL/target", "final KL/token", "final β",
                   "TensorBoard run")  # fmt: skip
        for column in columns:
            table.add_column(column, justify="right")
        for name, r in results.items():
            t, b = tracking[name], batch_tracking[name]
            judged = (f"{t.hits}/{t.judged} ({t.within:.0%})", f"{b.hits}/{b.judged} ({b.within:.0%})",
                      f"{b.noise_ceiling:.0%}", f"{t.mean_error:.3f}", f"{t.max_ratio:.2f}",
                      f"{r['kl_final']:.3g}")  # fmt: skip
            table.add_row(name, f"{r['before']:.3f}", f"{r['after']:.3f}", f"{r['after'] - r['before']:+.3f}",
                          *(judged if t.judged else ["— (no KL measured)", "—", "—", "—", "—", "—"]),
                          f"{r['coef_final']:.3g}", str(Path(log_dirs[name]).relative_to(directory)))  # fmt: skip
        table_console().print(table)
        if plot is not None:
            from megatron_ppo.runs.figure import plot_runs

            path = plot or directory / "compare-kl.png"
            title = (f"compare-kl {invocation}: the KL term off, fixed, adaptive, staged power law and staged PI "
                     "(same SFT start and data)")  # fmt: skip
            path = plot_runs(list(log_dirs.values()), path, names=list(log_dirs), title=title)
            table_console().print(f"figure: {path}")
    return results


def recipe_tracking(
    config: PPOConfig, total_steps: int, history: list[dict[str, float]], prefix: str = "kl/"
) -> KLTracking:
    """How a run's KL `<prefix>mean` (the batch's `kl/mean`, or the probe's `kl/probe_`) followed the stage targets
    of `config` (the recipe's, whatever KL control the run itself had): every variant judged against the same
    targets; the noise share from the batch's `kl/stderr` (the probe's rows do not change between steps)."""
    kl, stderr = logged_kl(history, prefix)
    staged = [c for c in build_kl_coefficients(config, total_steps).values() if isinstance(c, StagedKLSchedule)]
    if not staged:  # a recipe without stages: its one target throughout
        return kl_tracking(kl, dict.fromkeys(kl, config.algorithm.kl_ctrl.target_kl), dict.fromkeys(kl, 0), stderr)
    schedule = staged[0]
    # the metrics of step n are judged against the target of the stage that owned it (`runs/figure.py`, Schedule)
    stages = {n: schedule.stage_index_at(n - 1) for n in kl}
    return kl_tracking(kl, {n: schedule.stages[stages[n]].target_kl for n in kl}, stages, stderr)
