"""Hugging Face ↔ megatron-ppo checkpoints (`huggingface`: import under a TP/PP/EP layout, export a layer at a
time, `convert verify`) and the critic's initial weights (`critic_init`: a reward model's score head, or the
actor's trunk)."""
