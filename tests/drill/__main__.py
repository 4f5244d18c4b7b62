"""`make drill`: the tiny recipe with five faults injected at fixed steps (`faults.py`); each guard must fire where
expected, and nowhere else, and the run must still improve held-out accuracy by ≥ 0.15 over its SFT start. Every
guard but the optional plateau back-off (unit-tested) answers one of the faults.

    torchrun --nproc_per_node 2 -m tests.drill recipes/tiny-cpu.yaml [--short] [--plot FILE] [key=value ...]

`--short` is the test suite's shortened drill (a dozen steps on half the data); `--plot` draws the run's figure
(`report --plot`) with each injected fault marked at its step. Exit status 0 when every check holds;
the table of fault, step, guard and recovery is printed either way.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.plot import matplotlib_figure, plot_runs
from megatron_ppo.tasks import addition
from tests.drill.faults import Injector, install, schedule
from tests.drill.readback import check, drill_table

SCHEDULES = {
    # 30 steps, checkpoints and evaluations every 10: the KL blow-up at 12 rolls back to step 10
    "full": schedule(nan=3, spike=6, oom=8, blowup=12, drop=20),
    # 12 steps, checkpoints and evaluations every 4: the blow-up at 6 rolls back to step 4
    "short": schedule(nan=2, spike=3, oom=5, blowup=6, drop=8),
}
SHORT = [
    "data.addition.num_prompts=1000", "data.addition.num_heldout=200", "data.train_batch_size=256",
    "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size_per_gpu=64", "critic.ppo_mini_batch_size=64",
    "critic.ppo_micro_batch_size_per_gpu=64", "trainer.total_training_steps=12", "trainer.test_freq=4",
    "trainer.save_freq=4",
]  # fmt: skip
# Thresholds that make every guard answerable on this task's scale (the recipe's own guards stay as they are): a
# short loss history (the loss spike comes early) and a loss explosion at 100 × its median (a × 1000 loss gives
# ~1000 ×; the large-learning-rate step itself moves its later mini-batches' loss ~15 ×), the KL bump and the KL
# watch above any KL a healthy run reaches here (≤ 1 nat) but below a blow-up's (≥ 5).
# A drill is always a new run: continuing a finished one would inject nothing.
GUARDS = ["guards.grad_norm_window=4", "guards.loss_explosion_factor=100", "guards.kl_bump_threshold=2.0",
          "guards.watch=[{metric: kl/mean, max: 2.0, action: warn}]", "trainer.resume_mode=disable"]  # fmt: skip
MIN_GAIN = 0.15


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.drill", description=__doc__.splitlines()[0])
    parser.add_argument("recipe")
    parser.add_argument("--short", action="store_true")
    parser.add_argument("--plot", metavar="FILE", help="draw the run with the injected faults marked")
    args, overrides = parser.parse_known_args(argv)
    config = load_config(args.recipe, [*GUARDS, *(SHORT if args.short else []), *overrides])
    if args.plot:
        matplotlib_figure()  # a missing extra is named before the drill runs
    faults = SCHEDULES["short" if args.short else "full"]
    install(Injector(faults))
    try:
        summary = addition.run(config)
    except ConfigError as error:  # as the CLI reports it: the message, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") != "0":
        return 0
    rows, problems = check(config.trainer.log_dir, faults)
    gain = summary["accuracy_after"] - summary["accuracy_before"]
    if not args.short and gain < MIN_GAIN:
        problems.append(f"held-out accuracy rose by {gain:.3f} (SFT {summary['accuracy_before']:.3f} → "
                        f"{summary['accuracy_after']:.3f}); the drill needs ≥ {MIN_GAIN}")  # fmt: skip
    drill_table(rows, summary)
    if args.plot:
        marks = [(fault.step, fault.name) for fault in faults]
        print(f"figure: {plot_runs([config.trainer.log_dir], args.plot, marks=marks, title='fault drill')}")
    for problem in problems:
        print(f"DRILL FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("drill passed: every guard fired where expected and the run recovered")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
