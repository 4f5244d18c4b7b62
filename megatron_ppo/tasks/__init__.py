"""Embedded tasks: self-contained demos that build their own data and initial policy, then run offline PPO."""
