"""megatron-ppo: offline RLHF with PPO on the Megatron-Core backend."""

import sys

from megatron_ppo.startup import early_signals

early_signals.hold(sys.argv)  # first: a stop signal while `train` still imports (seconds) is answered, not lost

from megatron_ppo.startup import deferred_compile, lazy_modules  # noqa: E402 — after the signals are held

__version__ = "0.1.0"

deferred_compile.install()  # before any module of this package imports Megatron-Core
lazy_modules.install()
