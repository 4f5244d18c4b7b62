"""What a process of this package changes at its start, before it does any work: each a measure against a library's
behaviour at import or start-up, installed once and kept apart from the code it serves. Standard library only here
(and torch in `deferred_compile`): the package's `__init__` runs them before anything else of it is imported.

- `early_signals` — Python's default signal action: a Slurm SIGTERM/SIGUSR1 while `train` still imports torch and
  Megatron-Core (seconds) would kill the process without a line or the requeue marker; held from the package's
  first line until the preemption watch answers it (`train/preemption.py`).
- `deferred_compile` — Megatron-Core's `torch.compile` decorations at import: each imports torch's compiler stack
  (1.4 CPU-seconds a process) though nothing compiles until a first call; set up at that first call instead.
- `lazy_modules` — Megatron-Core's `megatron.core.timers` imports `wandb` at import (0.5 CPU-seconds), used only with
  a W&B logger; bound at once, executed at first use.
- `import_gc` — Python's cyclic garbage collector walking the ~350,000 objects the trainer's imports build while they
  are built; paused around the heavy imports and the result frozen (the command line's and the launcher's).
"""
