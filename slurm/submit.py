"""Submit a recipe to Slurm: validate its layout for the node count, size the job from its `cluster` section,
print the exact `sbatch` line, and submit it (or a chain of K jobs, each starting after the previous one succeeds).

    python slurm/submit.py RECIPE [--nodes N] [--chain K] [--score] [--log-dir DIR] [--dry-run] [key=value ...]

`--score` submits the scoring job instead (`megatron-ppo score`: rewards from `reward_model.*` for every row of the
recipe's data files, written to new Parquet files), on the same nodes; a chain of it is refused.

In a chain every job but the last must stop on its own before its time limit: unless the overrides set
`trainer.exit_interval` or `trainer.exit_duration_in_mins`, the latter is set to the time limit less 10 minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path


def in_the_projects_environment() -> None:
    """Run in megatron-ppo's environment whichever Python started this script: where this one cannot import the
    package, re-execute with the checkout's `.venv/bin/python` (what `make setup` builds), or end in one `error:`
    line saying how to run it (exit 2)."""
    try:
        import megatron_ppo.config  # noqa: F401
    except ImportError as missing:
        venv = Path(__file__).resolve().parents[1] / ".venv"
        if (venv / "bin" / "python").exists() and Path(sys.prefix).resolve() != venv.resolve():
            os.execv(venv / "bin" / "python", [str(venv / "bin" / "python"), __file__, *sys.argv[1:]])
        print(f"error: slurm/submit.py runs in megatron-ppo's environment, and this Python ({sys.executable}) cannot "
              f"import {missing.name}: run `make setup` and then `.venv/bin/python slurm/submit.py ...` (or "
              "`make submit`), or install the package into this Python (pip install -e .)",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None


if __name__ == "__main__":
    in_the_projects_environment()

from megatron_ppo.config import ConfigError, load_config  # noqa: E402

SBATCH_SCRIPT = Path(__file__).with_name("ppo.sbatch")
CHAIN_MARGIN_MINUTES = 10


def time_limit_minutes(limit: str) -> float:
    """Minutes in a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    match = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", limit.strip())
    if not match:
        raise ConfigError([f"cluster.time_limit={limit!r}: not a Slurm time (HH:MM:SS or D-HH:MM:SS)"])
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = int(first), int(second or 0), int(third or 0)
        return int(days) * 1440 + hours * 60 + minutes + seconds / 60
    if third is not None:  # HH:MM:SS
        return int(first) * 60 + int(second) + int(third) / 60
    return int(first) + int(second or 0) / 60  # MM or MM:SS


def chain_overrides(recipe: str, overrides: list[str]) -> list[str]:
    """The overrides that make each chained job stop cleanly before its time limit (none when already set)."""
    config = load_config(recipe, overrides)
    if config.trainer.exit_interval or config.trainer.exit_duration_in_mins:
        return []
    minutes = time_limit_minutes(config.cluster.time_limit) - CHAIN_MARGIN_MINUTES
    if minutes <= 0:
        raise ConfigError([f"a chained job needs cluster.time_limit above {CHAIN_MARGIN_MINUTES} minutes, or set "
                           "trainer.exit_interval=<steps per job>"])  # fmt: skip
    return [f"trainer.exit_duration_in_mins={minutes:g}"]


def sbatch_command(
    recipe: str, overrides: list[str], dependency: str | None = None, log_dir: str = "logs", command_name: str = "train"
) -> list[str]:
    """The sbatch argument list for `recipe` running `command_name` (train, or score; validated first; raises
    ConfigError naming what to change)."""
    config = load_config(recipe, overrides)
    cluster = config.cluster
    name = f"{'ppo' if command_name == 'train' else command_name}-{config.trainer.experiment_name}"
    command = ["sbatch", "--parsable", f"--nodes={cluster.nodes}", f"--ntasks-per-node={cluster.gpus_per_node}",
               f"--time={cluster.time_limit}", f"--job-name={name}", f"--output={log_dir}/%x-%j.out",
               f"--export=ALL,PPO_LOG_ROOT={log_dir},PPO_COMMAND={command_name}"]  # fmt: skip
    if cluster.device == "cuda":
        command.append(f"--gpus-per-node={cluster.gpus_per_node}")
    if cluster.partition:
        command.append(f"--partition={cluster.partition}")
    if cluster.account:
        command.append(f"--account={cluster.account}")
    if dependency:
        command.append(f"--dependency=afterok:{dependency}")
    return [*command, str(SBATCH_SCRIPT), recipe, *overrides]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--nodes", type=int, help="override cluster.nodes (the layout is re-validated for it)")
    parser.add_argument("--chain", type=int, default=1, help="submit K jobs, each starting after the previous")
    parser.add_argument("--score", action="store_true", help="submit the scoring job (megatron-ppo score) instead")
    parser.add_argument("--log-dir", default="logs", help="job stdout and per-job directories (default: logs)")
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch line(s) without submitting")
    args = parser.parse_intermixed_args(argv)
    overrides = [*args.overrides, *([f"cluster.nodes={args.nodes}"] if args.nodes else [])]
    previous = None
    if args.score and args.chain > 1:
        print("error: a scoring job runs once: drop --chain with --score", file=sys.stderr)
        return 2
    try:
        if args.chain > 1:
            overrides += chain_overrides(args.recipe, overrides)
        for _ in range(args.chain):
            command = sbatch_command(args.recipe, overrides, dependency=previous, log_dir=args.log_dir,
                                     command_name="score" if args.score else "train")  # fmt: skip
            print(shlex.join(command), flush=True)
            if args.dry_run:
                previous = previous or "<previous job id>"
                continue
            if shutil.which("sbatch") is None:
                print("error: sbatch is not on PATH: submit from a Slurm login node, or --dry-run", file=sys.stderr)
                return 1
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            submitted = subprocess.run(command, capture_output=True, text=True, check=False)
            if submitted.returncode != 0:
                print(f"error: sbatch refused the job: {submitted.stderr.strip()}", file=sys.stderr)
                return 1
            previous = submitted.stdout.strip().split(";")[0]
            print(f"submitted job {previous}", flush=True)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
