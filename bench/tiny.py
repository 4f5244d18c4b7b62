"""The tiny recipe shortened for tests and checks: half the prompts, half-size batches, evaluations every 4 steps
(each user sets its own number of PPO steps). The SFT stage keeps its full length: a weaker start policy gives PPO
too little signal to improve on. The end-to-end tests, the fault drill and `make gpu-check` all run this one."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny-cpu.yaml"
SHORT = [
    "data.addition.num_prompts=1000", "data.addition.num_heldout=200",
    "data.train_batch_size=256", "actor.ppo_mini_batch_size=64", "actor.ppo_micro_batch_size_per_gpu=64",
    "critic.ppo_mini_batch_size=64", "critic.ppo_micro_batch_size_per_gpu=64", "trainer.test_freq=4",
]  # fmt: skip
