"""A verl user's Megatron PPO overrides train the tiny offline recipe through the real CLI (`torchrun -m megatron_ppo
train`): the actor from a `transformers` Llama (`actor_rollout_ref.model.path`), the critic from a one-label Llama
reward model (`critic.model.path`), verl's over-long handling, `trainer.save_freq=-1`,
Hydra's `+trainer.val_before_train`, and W&B offline beside TensorBoard, over two jobs of one run (the first stops
at its budget and saves although save_freq=-1; the second resumes and saves nothing). Each job's W&B run file, read
back with W&B's own record format, holds the project and run name, the resolved config, and per step the
TensorBoard metrics."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ppo.config import load_config
from megatron_ppo.runs.report import read_run
from tests.e2e.wandb_files import read_wandb_run
from tests.support.hf_models import offline_recipe, save_hf_model, save_hf_scorer
from tests.support.tensorboard import scalars

REPO = Path(__file__).resolve().parents[2]


def _train(recipe: Path, overrides: list[str], log: Path) -> str:
    """One job of the real CLI with W&B offline; its log."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline",
           "WANDB_SILENT": "true"}  # fmt: skip
    with log.open("w") as out:
        result = subprocess.run(
            [str(torchrun), "--nproc_per_node=1", "--standalone", "-m", "megatron_ppo", "train",
             str(recipe), *overrides],
            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600, check=False,
        )  # fmt: skip
    text = log.read_text()
    assert result.returncode == 0, f"training exited {result.returncode}; log tail:\n{text[-4000:]}"
    return text


def test_verl_overrides_train_with_wandb_offline_and_its_run_file_matches_tensorboard(tmp_path: Path) -> None:
    actor_hf = save_hf_model("llama", tmp_path / "actor-hf", tied=False)
    reward_model = save_hf_scorer("llama", tmp_path / "reward-model")
    recipe_path = offline_recipe(tmp_path, actor_hf, tp=1)
    recipe = yaml.safe_load(recipe_path.read_text())
    del recipe["model"]["hf_checkpoint"]  # named below the verl way
    recipe_path.write_text(yaml.safe_dump(recipe))
    overrides = [
        f"actor_rollout_ref.model.path={actor_hf}", f"critic.model.path={reward_model}",
        "critic.model.enable_gradient_checkpointing=False",  # true: full recompute, which needs CUDA
        "data.filter_overlong_prompts=True", "data.truncation=error",
        "actor_rollout_ref.actor.optim.lr=1e-5", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=4", "trainer.logger=['console','tensorboard','wandb']",
        "trainer.project_name=verl_cli_e2e", "trainer.experiment_name=tiny_llama", "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1", "trainer.save_freq=-1", "+trainer.val_before_train=False",
        "trainer.total_training_steps=2", "trainer.exit_interval=1",  # two jobs of one step each
    ]  # fmt: skip
    checkpoints = tmp_path / "ckpt"
    first = _train(recipe_path, [*overrides, "trainer.resume_mode=disable"], tmp_path / "job1.log")
    assert "job budget" in first, "the first job should stop after its one step"
    saved = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))
    assert saved == ["step_1"], "with save_freq=-1 a job whose budget is spent still saves for the next job"
    _train(recipe_path, [*overrides, "trainer.resume_mode=auto"], tmp_path / "job2.log")
    saved = sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_"))
    assert saved == ["step_1"], "save_freq=-1 saved at the end of the run"
    _, events = read_run(tmp_path / "tb")
    critic_init = f"critic from the critic of {checkpoints}/hf_init_critic/step_0"
    assert [e.message for e in events if e.tag == "critic"] == [critic_init] * 2

    tensorboard = scalars(tmp_path / "tb")
    runs = [read_wandb_run(f) for f in sorted((tmp_path / "tb").glob("*/wandb/offline-run-*/run-*.wandb"))]
    assert [(run.project, run.name, sorted(run.history)) for run in runs] == [
        ("verl_cli_e2e", "tiny_llama", [1]),
        ("verl_cli_e2e", "tiny_llama", [2]),
    ], "each job writes its own offline file of the one W&B run"
    for run in runs:
        for step, logged in run.history.items():
            in_tensorboard = {tag: values[step] for tag, values in tensorboard.items() if step in values}
            assert sorted(logged) == sorted(in_tensorboard), f"step {step}: W&B and TensorBoard name other metrics"
            for tag, value in logged.items():
                assert value == pytest.approx(in_tensorboard[tag], rel=1e-6, abs=1e-6), f"step {step}: {tag} differs"

    resolved = load_config(recipe_path, [*overrides, "trainer.resume_mode=auto"])  # the config as validated
    assert runs[-1].config == dataclasses.asdict(resolved)
    assert resolved.data.overlong_policy == "filter"
