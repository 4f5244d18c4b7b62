"""The offline PPO loop and what any run needs around it: batches, experience, updates, optimizer, KL
coefficients, guards, metrics, preemption, and starting a run. Nothing here names a task."""
