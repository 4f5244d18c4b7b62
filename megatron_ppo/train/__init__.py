"""Training: the PPO loop and what it needs around it (KL coefficients, guards, checkpoints, metrics)."""
