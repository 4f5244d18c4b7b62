"""`make drill`: the tiny recipe with seven faults injected at fixed steps (`faults.py`); each guard must fire where
expected, and nowhere else, each rollback must load the good checkpoint it names, the KL must be back under
`guards.kl_explosion_threshold` after it, the evaluation drop's rollback must load the best evaluation's checkpoint,
and the run must still improve held-out accuracy over its SFT start by ≥ 0.15 (≥ 0.10 under `--short`). Then a
guard stop: a short run whose NaN gradients stop it, leaving its good checkpoint. Every guard but the optional
plateau back-off (unit-tested) answers one of the faults.

    torchrun --nproc_per_node 2 -m tests.drill recipes/tiny-cpu.yaml [--short | --stop | --oom-one-rank]
        [--plot FILE] [key=value ...]

`--short` is the test suite's shortened drill (a dozen steps on half the data, no stop); `--stop` only the guard
stop, exiting as `megatron_ppo train` does (`GUARD_STOP_EXIT`); `--oom-one-rank` an out-of-memory error on the last
of two data-parallel ranks only, mid-update: that rank stops the run with one message and
`OUT_OF_MEMORY_STOP_EXIT`, the checkpoint `latest` names left (the other rank, inside its gradient reduce, ends with
the connection); `--plot` draws the run's figure (`report --plot`)
with each injected fault marked at its step. Otherwise exit status 0 when every check holds; the table of fault,
step, guard and recovery is printed either way.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from bench.tiny import SHORT as TINY_SHORT
from megatron_ppo.cli import report_guard_stop
from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.runs.figure import matplotlib_figure, plot_runs
from megatron_ppo.tasks.addition.recipe import prepare_addition_task, run_addition_recipe, train_on_task
from megatron_ppo.train.guards import GuardStopped
from megatron_ppo.train.run import distributed_run
from tests.drill.faults import Injector, install, one_rank_out_of_memory_schedule, schedule, stop_schedule
from tests.drill.readback import check, check_stop, drill_table

SCHEDULES = {
    # 30 steps, evaluations every 10, checkpoints every 5: the KL blow-up at 12 (between saves) rolls back to step
    # 10; the one in the last step of 15 (a save) is seen at 16 and rolls back to step 10, passing step 15 over
    "full": schedule(nan=3, spike=6, oom=(8, 9), blowup=(12, 10), drop=20, at_save=(15, 10)),
    # 12 steps, evaluations every 4, checkpoints every 2: the blow-up at 7 rolls back to step 4 (step 6 had not
    # passed 7's guards); the one in the last step of 10 is seen at 11 and rolls back to step 8
    "short": schedule(nan=2, spike=3, oom=(5, 6), blowup=(7, 4), drop=8, at_save=(10, 8)),
}
FULL = ["trainer.save_freq=5"]
SHORT = [*TINY_SHORT, "trainer.total_training_steps=12", "trainer.save_freq=2"]
# The guard stop (on the drill's own task: its cache is reused): NaN gradients from step 3 with no skip allowed;
# steps 1 and 2 are saved, and step 2's save is the one step 3 judges, so the checkpoint left is step 1's. No
# evaluation: nothing to measure.
STOP_AT = 3
STOP = ["trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.test_freq=0",
        "trainer.val_before_train=false", "guards.max_consecutive_skips=0"]  # fmt: skip
# The one-rank out-of-memory drill: DP 2 (TP 1), a save after every step, the error at step 3; a rank waits 5 s for
# the others to agree on a retry (the other rank never arrives: it waits in its gradient reduce).
ONE_RANK_OOM_AT = 3
ONE_RANK_OOM = ["trainer.total_training_steps=4", "trainer.save_freq=1", "trainer.test_freq=0",
                "trainer.val_before_train=false", "guards.oom_agreement_timeout_s=5",
                "actor.ppo_micro_batch_size_per_gpu=32", "critic.ppo_micro_batch_size_per_gpu=32",
                *(f"{role}.megatron.tensor_model_parallel_size=1" for role in ("actor", "ref", "critic"))]  # fmt: skip
# Thresholds that make every guard answerable on this task's scale (the recipe's own guards stay as they are): a
# short loss history (the loss spike comes early) and a loss explosion at 100 × its median (a × 1000 loss gives
# ~1000 ×; the large-learning-rate step itself moves its later mini-batches' loss ~15 ×), the KL bump and the KL
# watch (on the update's KL, as the guards read it) above any KL a healthy run reaches here (≤ 1 nat) but below a
# blow-up's (≥ 5); room for the drill's four rollbacks. A drill is always a new run: continuing a finished one
# would inject nothing.
GUARDS = ["guards.grad_norm_window=4", "guards.loss_explosion_factor=100", "guards.kl_bump_threshold=2.0",
          "guards.watch=[{metric: actor/ref_kl, max: 2.0, action: warn}]", "guards.max_rollbacks=4",
          "trainer.resume_mode=disable"]  # fmt: skip
# The held-out accuracy gain the drill needs over its SFT start, about half of what it measures (full: `make drill`;
# short, the test suite's: 0.570 → 0.775, +0.205, with its four rollbacks in 12 steps).
MIN_GAIN = {"full": 0.15, "short": 0.10}


def stop_run(config: PPOConfig) -> GuardStopped | None:
    """The guard-stop drill's run (inside the process groups): the `GuardStopped` it ended with, None if it did not."""
    try:
        train_on_task(config, prepare_addition_task(config))
    except GuardStopped as stop:
        return stop
    return None


def stop_config(config: PPOConfig, argv_overrides: list[str], recipe: str) -> PPOConfig:
    """The guard stop's config: its own checkpoint and log folders beside the drill's."""
    where = [f"trainer.default_local_dir={config.trainer.default_local_dir}/stop",
             f"trainer.log_dir={config.trainer.log_dir}/stop"]  # fmt: skip
    return load_config(recipe, [*GUARDS, *FULL, *argv_overrides, *STOP, *where])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.drill", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--stop", action="store_true")
    parser.add_argument("--oom-one-rank", action="store_true")
    parser.add_argument("--plot", metavar="FILE", help="draw the run with the injected faults marked")
    args, overrides = parser.parse_known_args(argv)
    if args.plot:
        matplotlib_figure()  # a missing extra is named before the drill runs
    try:
        if args.stop:
            return _stop_only(load_config(args.recipe, [*GUARDS, *SHORT, *overrides, *STOP]))
        if args.oom_one_rank:
            return _one_rank_out_of_memory(load_config(args.recipe, [*GUARDS, *SHORT, *overrides, *ONE_RANK_OOM]))
        config = load_config(args.recipe, [*GUARDS, *(SHORT if args.short else FULL), *overrides])
        stopping = None if args.short else stop_config(config, overrides, args.recipe)
        faults = SCHEDULES["short" if args.short else "full"]
        injector = Injector(faults)
        install(injector)
        with distributed_run(config):
            summary = run_addition_recipe(config)
            if stopping is not None:
                injector.faults, injector.done = stop_schedule(STOP_AT), set()
                stopped = stop_run(stopping)
    except ConfigError as error:  # as the CLI reports it: the message, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") != "0":
        return 0
    rows, problems = check(config.trainer.log_dir, faults, config.guards.kl_explosion_threshold)
    if stopping is not None:
        row, stop_problems = check_stop(stopped, stopping, STOP_AT)
        rows.append(row)
        problems += stop_problems
    gain, min_gain = summary["accuracy_after"] - summary["accuracy_before"], MIN_GAIN["short" if args.short else "full"]
    if gain < min_gain:
        problems.append(f"held-out accuracy rose by {gain:.3f} (SFT {summary['accuracy_before']:.3f} → "
                        f"{summary['accuracy_after']:.3f}); the drill needs ≥ {min_gain}")  # fmt: skip
    drill_table(rows, summary)
    if args.plot:
        marks = [(fault.step, fault.name) for fault in faults]
        print(f"figure: {plot_runs([config.trainer.log_dir], args.plot, marks=marks, title='fault drill')}")
    for problem in problems:
        print(f"DRILL FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("drill passed: every guard fired where expected and the run recovered")
    return 1 if problems else 0


def _stop_only(config: PPOConfig) -> int:
    """`--stop`: the guard stop alone, reported and exited as the command line does."""
    install(Injector(stop_schedule(STOP_AT)))
    with distributed_run(config):
        stopped = stop_run(config)
    if stopped is None:
        print(f"DRILL FAILED: no guard stopped the run at step {STOP_AT}", file=sys.stderr)
        return 1
    report_guard_stop(stopped)
    return stopped.exit_status


def _one_rank_out_of_memory(config: PPOConfig) -> int:
    """`--oom-one-rank`: the rank that runs out of memory ends the process itself (`memory_backoff.py`); reaching
    the end of the run is the failure."""
    install(Injector(one_rank_out_of_memory_schedule(ONE_RANK_OOM_AT)))
    with distributed_run(config):
        train_on_task(config, prepare_addition_task(config))
    print(f"DRILL FAILED: the run went on past the one-rank out-of-memory error at step {ONE_RANK_OOM_AT}",
          file=sys.stderr)  # fmt: skip
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
