"""A worker for plain `torchrun` that makes its races certain: `python -m tests.support.torchrun_worker MODE ARGS`
runs `python -m megatron_ppo ARGS` on every rank, except that
- `rank-0-late`: rank 0 starts 3 s after the others (the others meet a shared error first, and exit);
- `rank-1-fails`: rank 1 exits 1 after 3 s without starting (a peer that fails while rank 0 is in its set-up)."""

from __future__ import annotations

import os
import runpy
import sys
import time

LATE_S = 3.0

if __name__ == "__main__":
    mode, rank = sys.argv[1], os.environ["RANK"]
    if mode == "rank-1-fails" and rank == "1":
        time.sleep(LATE_S)
        sys.exit(1)
    if mode == "rank-0-late" and rank == "0":
        time.sleep(LATE_S)
    sys.argv = ["-m", *sys.argv[2:]]  # as `python -m megatron_ppo …` has it while the package is imported
    runpy.run_module("megatron_ppo", run_name="__main__", alter_sys=True)
