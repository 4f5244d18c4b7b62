"""The Slurm submit wrapper: sizes the job from the recipe, validates the layout for the node count first, passes
overrides as separate arguments, and chains jobs with afterok dependencies."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ppo.config import ConfigError
from slurm.submit import main, sbatch_command

REPO = Path(__file__).resolve().parents[2]


def test_job_is_sized_from_the_cluster_section() -> None:
    command = sbatch_command(
        str(REPO / "recipes" / "qwen2.5-32b.yaml"), ["cluster.partition=gpu", "cluster.account=rl"]
    )
    assert command[:2] == ["sbatch", "--parsable"]
    for flag in ("--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--partition=gpu", "--account=rl"):
        assert flag in command
    assert command[-3:] == [str(REPO / "recipes" / "qwen2.5-32b.yaml"), "cluster.partition=gpu", "cluster.account=rl"]


def test_cpu_recipe_asks_for_no_gpus() -> None:
    command = sbatch_command(str(REPO / "recipes" / "tiny-cpu.yaml"), [])
    assert "--ntasks-per-node=2" in command and not any(c.startswith("--gpus") for c in command)


def test_an_impossible_node_count_is_refused_before_submitting() -> None:
    with pytest.raises(ConfigError, match="world size 24"):
        sbatch_command(str(REPO / "recipes" / "qwen2.5-32b.yaml"), ["cluster.nodes=3"])


def test_override_with_spaces_stays_one_argument() -> None:
    command = sbatch_command(str(REPO / "recipes" / "tiny-cpu.yaml"), ["trainer.experiment_name=a b"])
    assert command[-1] == "trainer.experiment_name=a b"


def test_dry_run_chain_prints_dependent_jobs(capsys) -> None:
    assert main([str(REPO / "recipes" / "tiny-cpu.yaml"), "--dry-run", "--chain", "3"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 3 and "--dependency" not in lines[0]
    assert all("--dependency=afterok:" in line for line in lines[1:])
