"""A run's checkpoints: their contents (`store`: Megatron's distributed checkpointing of models and optimizers,
RNG and trainer state), the directory they live in (`directory`: `step_N`, `latest`, completeness, pruning), the
identity of the run that saved them (`run_identity`), which run a job starts or continues there (`run_start`),
the weights a run's models start from (`initial_weights`), and a role's weights read a layer at a time without a
model (`weights`, for the export)."""
