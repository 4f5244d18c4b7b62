"""What a user switches on to see where an iteration's time and memory go (`profiling.*`, Megatron-Bridge's
`ProfilingConfig` key names): over the iterations `profile_step_start` ≤ n < `profile_step_end`, on the ranks
`profile_ranks`,

- `use_pytorch_profiler`: a torch-profiler trace (CPU and, on GPUs, CUDA activity; shapes with `record_shapes`),
  one Chrome/Perfetto trace file per rank in the run's log folder (`trace_path`);
- `use_nsys_profiler`: `cudaProfilerStart` / `cudaProfilerStop` around the range, for
  `nsys profile --capture-range=cudaProfilerApi`;
- `record_memory_history`: the CUDA allocator's history from the range's start, dumped as a memory snapshot
  (`memory_snapshot_path`, for pytorch.org/memory_viz) at its end, or at the first out-of-memory error.

Every iteration's phases are named ranges (`phase`): `iteration N`, `experience` with `experience/old_log_prob`,
`experience/ref_log_prob` and `experience/values`, `update_critic`, `update_actor`, `evaluation` and `save` — as
`record_function` ranges in the torch trace and, with `nvtx_ranges`, as NVTX ranges in an `nsys` capture. NVTX and
the memory snapshot need CUDA: on the CPU they do nothing, and say so once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from megatron_ppo.config.schema import ProfilingConfig

TRACES = "profile"  # the folder, under the run's log folder, that holds its traces and memory snapshots
_nvtx_on = False  # NVTX ranges beside the torch ranges: profiling.nvtx_ranges on CUDA


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """A named range: in the torch profiler's trace when one records, in an `nsys` capture with `nvtx_ranges`."""
    with torch.profiler.record_function(name):
        if _nvtx_on:
            torch.cuda.nvtx.range_push(name)
        try:
            yield
        finally:
            if _nvtx_on:
                torch.cuda.nvtx.range_pop()


def trace_path(log_dir: str | Path, rank: int, start: int, end: int) -> Path:
    return Path(log_dir) / TRACES / f"rank{rank}.steps{start}-{end - 1}.pt.trace.json"


class Profiler:
    """Starts and stops what `profiling.*` asks for around the step range, on this rank; `say` logs a line."""

    def __init__(self, config: ProfilingConfig, log_dir: str | Path, rank: int, say: Callable[[str], None]) -> None:
        global _nvtx_on
        self.config = config
        self.rank, self.say = rank, say
        self.folder = Path(log_dir) / TRACES
        self.here = rank in config.profile_ranks
        on_cuda = torch.cuda.is_available()
        self.torch_profiler: torch.profiler.profile | None = None
        self.nsys_running = False
        wanted_cuda = [key for key in ("nvtx_ranges", "use_nsys_profiler", "record_memory_history")
                       if getattr(config, key)]  # fmt: skip
        if self.here and wanted_cuda and not on_cuda:
            say(f"profiling.{', profiling.'.join(wanted_cuda)}: no CUDA on this machine, nothing recorded for "
                "them (the torch profiler's trace works on the CPU)")  # fmt: skip
        self.cuda = self.here and on_cuda
        _nvtx_on = self.cuda and config.nvtx_ranges
        self.memory_history = self.cuda and config.record_memory_history
        self.snapshot_written = False

    def begin(self, number: int) -> None:
        """Before iteration `number` (1, 2, …): start what the range starts with."""
        if not self.here or number != self.config.profile_step_start:
            return
        if self.config.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.torch_profiler = torch.profiler.profile(activities=activities,
                                                         record_shapes=self.config.record_shapes)  # fmt: skip
            self.torch_profiler.start()
        if self.cuda and self.config.use_nsys_profiler:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.nsys_running = True
        if self.memory_history:
            torch.cuda.memory._record_memory_history(max_entries=100_000)

    def end(self, number: int) -> None:
        """After iteration `number`: stop at the range's last iteration."""
        if self.here and number == self.config.profile_step_end - 1:
            self.close()

    def close(self) -> None:
        """Stop whatever still runs (the range's end, or a run that ended inside it) and write its files."""
        config = self.config
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            path = trace_path(self.folder.parent, self.rank, config.profile_step_start, config.profile_step_end)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.torch_profiler.export_chrome_trace(str(path))
            self.torch_profiler = None
            self.say(f"torch profiler trace of iterations {config.profile_step_start}–{config.profile_step_end - 1}"
                     f" on rank {self.rank}: {path} (open in ui.perfetto.dev or chrome://tracing)")  # fmt: skip
        if self.nsys_running:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.nsys_running = False
        if self.memory_history and not self.snapshot_written:
            self.snapshot("at the end of the profiled range")

    def out_of_memory(self) -> None:
        """An out-of-memory error: the allocator's history up to it, once."""
        if self.memory_history and not self.snapshot_written:
            self.snapshot("at an out-of-memory error")

    def snapshot(self, when: str) -> None:
        given = Path(self.config.memory_snapshot_path)  # relative: in the run's profile folder
        path = (given.parent if given.is_absolute() else self.folder / given.parent) / f"rank{self.rank}.{given.name}"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(path))
        torch.cuda.memory._record_memory_history(enabled=None)
        self.snapshot_written = True
        self.say(f"CUDA memory snapshot {when} on rank {self.rank}: {path} (open in pytorch.org/memory_viz)")
