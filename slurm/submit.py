"""Submit a recipe to Slurm: validate its layout for the node count, size the job from its `cluster` section,
print the exact `sbatch` line, and submit it (or a chain of N jobs, each after the previous one succeeds).

    python slurm/submit.py RECIPE [--nodes N] [--chain K] [--dry-run] [key=value ...]
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from pathlib import Path

from megatron_ppo.config import ConfigError, load_config

SBATCH_SCRIPT = Path(__file__).with_name("ppo.sbatch")


def sbatch_command(recipe: str, overrides: list[str], dependency: str | None = None) -> list[str]:
    """The sbatch argument list for `recipe` (validated first; raises ConfigError naming what to change)."""
    config = load_config(recipe, overrides)
    cluster = config.cluster
    command = ["sbatch", "--parsable", f"--nodes={cluster.nodes}", f"--ntasks-per-node={cluster.gpus_per_node}",
               f"--time={cluster.time_limit}", f"--job-name=ppo-{config.trainer.experiment_name}"]  # fmt: skip
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
    parser.add_argument("--dry-run", action="store_true", help="print the sbatch line(s) without submitting")
    args = parser.parse_intermixed_args(argv)
    overrides = [*args.overrides, *([f"cluster.nodes={args.nodes}"] if args.nodes else [])]
    previous = None
    try:
        for _ in range(args.chain):
            command = sbatch_command(args.recipe, overrides, dependency=previous)
            print(shlex.join(command))
            if args.dry_run:
                previous = previous or "<previous job id>"
                continue
            previous = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().split(";")[0]
            print(f"submitted job {previous}")
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
