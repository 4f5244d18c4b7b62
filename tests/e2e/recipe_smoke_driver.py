"""Under torchrun: several CLI training commands in one process group, one after the other, as
`python -m megatron_ppo train ...` would run each (`megatron_ppo.cli.main`, which starts and tears down the process
groups of its run). Saves a launch per command — the recipe smoke tests run every shrunk recipe of a world size
and its resume this way.

    torchrun --nproc_per_node N -m tests.e2e.recipe_smoke_driver PLAN.json RESULTS.json

PLAN.json: a list of {"name": str, "argv": [str, ...]} (argv after `megatron_ppo`); rank 0 writes RESULTS.json:
{name: {"exit": int, "seconds": float}}, every command's exit status and wall time, after each command.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from megatron_ppo.cli import main as cli_main
from megatron_ppo.parallel import dist_env_from_environment


def run_plan(plan: list[dict], results_path: Path) -> int:
    """Each command of `plan` in turn; the first that fails ends the plan (its exit status is returned)."""
    results: dict[str, dict] = {}
    for command in plan:
        start = time.perf_counter()
        status = cli_main(command["argv"])
        results[command["name"]] = {"exit": status, "seconds": time.perf_counter() - start}
        if dist_env_from_environment().rank == 0:
            results_path.write_text(json.dumps(results, indent=1))
        if status != 0:
            return status
    return 0


if __name__ == "__main__":
    sys.exit(run_plan(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])))
