"""A run's checkpoints: their contents (`store`: Megatron's distributed checkpointing of models and optimizers,
RNG and trainer state), the directory they live in (`directory`: `step_N`, `latest`, completeness, pruning), the
identity of the run that saved them (`run_identity`), which run a job starts or continues there (`run_start`),
the weights a run's models start from (`initial_weights`), a role's weights read a layer at a time without a
model (`weights`, for the export), which checkpoint a path or a resume names and whether it holds the
config's model, before any work (`named`, `shapes`), the manifest that says whether a checkpoint's files are all
there (`verify`), and the lock that gives a run directory one writer (`lock`)."""
