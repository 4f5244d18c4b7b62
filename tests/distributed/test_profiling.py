"""`profiling.*`: a torch-profiler trace over the chosen iterations, on the chosen ranks, naming the phases."""

from __future__ import annotations

from tests.distributed import profiling_workers
from tests.distributed.harness import run_distributed

PHASES = ["experience", "experience/old_log_prob", "experience/ref_log_prob", "experience/values", "save",
          "update_actor", "update_critic"]  # fmt: skip


def test_a_trace_covers_exactly_the_chosen_iterations_on_the_chosen_rank_and_names_the_phases(tmp_path) -> None:
    """Iterations 2 and 3 (profile_step_start=2, profile_step_end=4) of 4, on rank 1 only; a save at step 3."""
    overrides = ["trainer.total_training_steps=4", "trainer.save_freq=3", "profiling.use_pytorch_profiler=true",
                 "profiling.profile_step_start=2", "profiling.profile_step_end=4", "profiling.profile_ranks=[1]",
                 "profiling.nvtx_ranges=true"]  # fmt: skip
    rank0, rank1 = run_distributed(profiling_workers.profiled_run, 2, str(tmp_path), overrides)
    assert rank0["traces"] == [] and rank0["names"] is None, rank0
    assert rank1["traces"] == ["rank1.steps2-3.pt.trace.json"], rank1
    iterations = [name for name in rank1["names"] if name.startswith("iteration ")]
    assert iterations == ["iteration 2", "iteration 3"], rank1["names"]
    # the phases, beside torch's own annotations (`Optimizer.step#…`, `gloo:all_reduce`)
    assert set(PHASES) <= set(rank1["names"]), sorted(set(PHASES) - set(rank1["names"]))
    # on the CPU, NVTX says once that it records nothing; the rank outside profile_ranks says nothing
    assert rank0["said"] == [], rank0["said"]
    nvtx = [line for line in rank1["said"] if "profiling.nvtx_ranges" in line]
    assert len(nvtx) == 1 and "no CUDA" in nvtx[0], rank1["said"]
    assert any("rank1.steps2-3.pt.trace.json" in line for line in rank1["said"]), rank1["said"]
