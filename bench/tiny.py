"""The tiny recipe shortened for tests and checks: half the prompts, half-size batches, evaluations every 4 steps
(each user sets its own number of PPO steps), and the task's 1000 SFT steps, not the recipe's 2000: at the default
seed 1000 already start PPO from ~0.57 of the held-out sums (the recipe's 2000 are for the seeds where 1000 stop on a
plateau); fewer give PPO too little signal to improve on. The KL probe takes 512 rows, not 2048: two batches of this
size, where 2048 would be eight actor forwards a step. The end-to-end tests, the fault drill and `make gpu-check`
all run this one."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
SHORT = [
    "data.addition.num_prompts=1000", "data.addition.num_heldout=200", "data.addition.sft_steps=1000",
    "data.train_batch_size=256", "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size_per_gpu=64",
    "critic.ppo_mini_batch_size=64", "critic.ppo_micro_batch_size_per_gpu=64", "trainer.test_freq=4",
    "algorithm.kl_ctrl.probe_rows=512",
]  # fmt: skip
