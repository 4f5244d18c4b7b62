"""The one list of what cannot run on CPU: each setting with its reason and the `make gpu-check` part that runs it.

Validation refuses each on `cluster.device=cpu` (`validate.py` reads this list); docs/gpu.md's table is this list;
`tests/unit/test_cpu_coverage.py` fails when a shipped recipe sets a layout or feature flag that neither a CPU test
covers nor this list names. Everything else a recipe sets — TP with sequence parallelism, PP with virtual stages,
the distributed optimizer with overlapped DP communication, full and selective recompute, EP/expert-TP with the
allgather dispatcher, host offload, dynamic batch sizes — runs in the CPU suite at tiny size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from megatron_ppo.config.schema import ROLES, PPOConfig


@dataclass(frozen=True)
class GpuOnly:
    """A setting that needs CUDA: `setting` as a recipe writes it, `present` whether `config` sets it, `problem`
    the validation line (naming the fix), `reason` why the CPU cannot run it, `gpu_check` what covers it on a GPU,
    `cpu_stand_in` the overrides that run the rest of such a recipe on CPU (the recipe smoke tests apply them)."""

    setting: str
    present: Callable[[PPOConfig], bool]
    problem: Callable[[PPOConfig], str]
    reason: str
    gpu_check: str
    cpu_stand_in: tuple[str, ...]


GPU_ONLY: tuple[GpuOnly, ...] = (
    GpuOnly(
        setting="model.transformer_impl=transformer_engine",
        present=lambda c: c.model.transformer_impl == "transformer_engine",
        problem=lambda c: (
            "model.transformer_impl='transformer_engine' needs CUDA, but cluster.device='cpu'; "
            "use 'auto' or 'local' on CPU"
        ),
        reason="Transformer Engine's fused layers, norms, attention and FP8 are CUDA kernels",
        gpu_check="(a) tiny recipe and (b) PPO iteration, on the TE path where TE imports (the table names the path)",
        cpu_stand_in=("model.transformer_impl=auto",),
    ),
    GpuOnly(
        setting="model.moe_token_dispatcher=alltoall",
        present=lambda c: bool(c.model.num_experts) and c.model.moe_token_dispatcher == "alltoall",
        problem=lambda c: (
            "model.moe_token_dispatcher='alltoall' needs CUDA (Megatron creates a CUDA stream for it), "
            "but cluster.device='cpu'; use 'allgather' on CPU"
        ),
        reason="Megatron's alltoall dispatcher creates a CUDA stream; on CPU the allgather dispatcher runs the same "
        "experts, routers and EP/expert-TP layouts",
        gpu_check="not covered (one GPU has no expert-parallel group): the first multi-GPU MoE run",
        cpu_stand_in=("model.moe_token_dispatcher=allgather",),
    ),
    GpuOnly(
        setting="megatron.context_parallel_size>1",
        present=lambda c: c.actor.megatron.context_parallel_size > 1,
        problem=lambda c: (
            f"actor.megatron.context_parallel_size={c.actor.megatron.context_parallel_size} needs "
            "Transformer Engine attention (GPU); use 1 on CPU"
        ),
        reason="only Transformer Engine's attention exchanges keys and values around the CP ring (the local and "
        "SDPA attention see this rank's tokens only); the CP split, padding and loss scale are CPU-tested",
        gpu_check="not covered (one GPU): the first CP run on 2 GPUs",
        cpu_stand_in=tuple(f"{role}.megatron.context_parallel_size=1" for role in ROLES),
    ),
)


def cpu_problems(config: PPOConfig) -> list[str]:
    """The validation line of each `GPU_ONLY` setting `config` sets, on `cluster.device=cpu`."""
    if config.cluster.device != "cpu":
        return []
    return [entry.problem(config) for entry in GPU_ONLY if entry.present(config)]


@dataclass(frozen=True)
class CudaBranch:
    """A branch of the code only CUDA takes, beside the settings above that cannot run on CPU at all: `where` it
    is, `forced_by` the setting or test hook that makes a CPU run take it (never a mock of Megatron), and `test`
    the CPU test that runs it (`tests/unit/test_cpu_coverage.py` checks each test exists), or why none can."""

    where: str
    forced_by: str
    test: str


BUCKET = "megatron.make_sequence_length_divisible_by=128 (the setting the CUDA default stands for)"
CUDA_BRANCHES: tuple[CudaBranch, ...] = (
    CudaBranch(
        "models/widths.py width_bucket: every width rounded up to 128, padding at position 0 (models/moe.py)",
        BUCKET,
        "tests/distributed/test_update_path.py::test_sft_under_the_cuda_width_bucket_equals_sft_without_it"
        " (learned positions and RoPE); "
        "tests/e2e/test_tiny_recipe.py::test_pp2_under_the_cuda_width_bucket_gives_the_tp2_runs_first_steps",
    ),
    CudaBranch(
        "models/gpt.py logits_cut: logits of the real tokens only under the bucket (in-place gradient)",
        BUCKET,
        "tests/distributed/test_vocab_parallel_logprobs.py::"
        "test_the_width_bucket_keeps_one_logits_buffer_with_its_gradient_in_place",
    ),
    CudaBranch(
        "models/kernels.py sdpa_backend: the kernel named for the training rows, padded width and gradients",
        BUCKET,
        "tests/distributed/test_sdpa_attention.py::test_the_start_line_names_the_attention_kernel_a_training_step_runs",
    ),
    CudaBranch(
        "models/kernels.py fusion_flags: fusions by what imports (apex's and TE's kernels present)",
        "torch.cuda.is_available reported True; fusion_flags(importable=...)",
        "tests/unit/test_device.py::test_with_every_kernel_importable_the_tiny_recipes_layer_norm_builds_on_cuda",
    ),
    CudaBranch(
        "models/transformer_config.py: weights drawn on the GPU, batched pipeline messages",
        "torch.cuda.is_available reported True",
        "tests/unit/test_device.py::test_cuda_config_initialises_on_the_gpu_with_only_importable_fusions",
    ),
    CudaBranch(
        "train/memory_backoff.py: torch.OutOfMemoryError from CUDA's allocator, on every rank or on one",
        "the drill's injected error (tests/drill/faults.py)",
        "tests/distributed/test_data_parallel_overlap.py::"
        "test_out_of_memory_in_a_backward_is_retried_and_equals_a_run_without_it; tests/e2e/test_fault_drill.py",
    ),
    CudaBranch(
        "gpu_check/resume.py: gradient norms held within 1e-3 instead of bitwise",
        "none (the bound only widens a comparison the CPU makes bitwise)",
        "tests/e2e/test_gpu_check_dry_run.py::"
        "test_gpu_check_dry_run_runs_every_part_in_its_own_process_and_streams_its_table (bitwise)",
    ),
    CudaBranch(
        "parallel/device.py to_device/host_copy: a micro-batch pinned (a buffer of its own strides) and copied "
        "non_blocking",
        "every CPU run: the same staging into a plain buffer of the tensor's strides, which refuses what pinning "
        "refuses (an expanded or overlapping layout)",
        "tests/unit/test_device.py::test_host_tensors_reach_the_model_device_as_dense_copies_of_any_layout; "
        "tests/distributed/test_kv_cache_decoding.py (the cached decoder's stride-0 positions)",
    ),
    CudaBranch(
        "models/failed_pass.py release_failed_pass: a pass that ran out of memory on the GPU releases what Megatron's "
        "layers keep",
        "an OutOfMemoryError raised in linear_fc1 during an update (a forward pre-hook), the collector off",
        "tests/distributed/test_memory_release.py::test_a_failed_pass_is_released_before_its_retry; "
        "tests/distributed/test_memory_release.py::test_without_the_release_megatron_keeps_the_failed_pass",
    ),
    CudaBranch(
        "models/gpt.py, train/callbacks.py: a dropped trainer's CUDA memory back without the collector",
        "none needed: the same references on the CPU (weak references with the collector off); the GPU check's (g) "
        "reads memory_allocated",
        "tests/distributed/test_memory_release.py::test_dropped_trainers_and_the_sft_model_are_freed_without_the_collector",
    ),
    CudaBranch(
        "models/attention.py packed_attention_path: one torch varlen_attn (flash) call per layer on CUDA (sm80+, "
        "bf16/fp16)",
        "the choice forced both ways; a stand-in computing what torch documents for varlen_attn (no CPU kernel); the "
        "GPU check's (j) runs the real one",
        "tests/unit/test_packed_attention.py::test_the_varlen_path_is_chosen_only_where_torch_varlen_runs; "
        "tests/unit/test_packed_attention.py::test_a_pack_runs_as_one_causal_varlen_call_equal_to_the_per_sequence_path",
    ),
    CudaBranch(
        "models/kernels.py: the compiled fusions, recompiles across pack widths (TorchInductor emits Triton on CUDA, "
        "C++ on the CPU)",
        "every CPU run compiles them (dynamic shapes)",
        "tests/unit/test_fusion_recompiles.py::test_the_compiled_fusions_compile_at_most_twice_over_many_pack_widths",
    ),
    CudaBranch(
        "checkpoint/store.py rng_states: the CUDA generator and Megatron's CUDA RNG tracker saved and restored",
        "the CPU twins (host generator, the CPU tracker); the GPU check's (f) resumes on CUDA bitwise",
        "tests/unit/test_checkpoint_rng.py::test_rng_states_resume_host_and_tracked_streams",
    ),
    CudaBranch(
        "checkpoint/async_save.py: the writer forked from a process with a CUDA context (shards copied to host first)",
        "none: a CPU process has no CUDA context to fork; the same forked writer runs on the CPU",
        "tests/distributed/test_async_save.py::test_an_async_save_returns_before_its_write_and_resumes_like_a_sync_save",
    ),
    CudaBranch(
        "gpu_check/__main__.py part_processes: parts spawned on CUDA (megatron-core's import initialises CUDA), forked"
        " on the CPU",
        "the spawn start method forced on the CPU by hand (2026-12-04); the dry run forks",
        "tests/e2e/test_gpu_check_dry_run.py::test_gpu_check_dry_run_runs_every_part_in_its_own_process_and_streams_its_table",
    ),
    CudaBranch(
        "models/generation.py cache_rows: the KV cache's rows sized from the free device memory",
        "none: the CPU has no device memory query; at_most rows there",
        "tests/distributed/test_kv_cache_decoding.py",
    ),
    CudaBranch(
        "models/offload.py: pinned host buffers, non_blocking copies",
        "none: pinning needs a CUDA context; the same copies run unpinned on CPU",
        "tests/distributed/test_host_offload.py::test_an_offloaded_run_equals_one_without_offload (unpinned)",
    ),
    CudaBranch(
        "gpu_check/card.py measure_card: the card read on the device (memory, its context alone, bf16 matmul rate),"
        " every part sized to it",
        "a named card (`--dry-run --card h100|h200`: the spec's memory, an assumed context and rate)",
        "tests/unit/test_gpu_check_sizing.py::test_the_dry_run_for_a_card_plans_every_part_within_its_budget",
    ),
    CudaBranch(
        "gpu_check/first_update.py: cuBLAS workspaces released before the allocator is read; the KL bound widened"
        " to bf16 noise where cuDNN or TE attention runs",
        "none: the CPU has no cuBLAS workspace and runs one attention kernel (the strict bound); unverified on a GPU",
        "tests/e2e/test_gpu_check_dry_run.py::test_gpu_check_dry_run_runs_every_part_in_its_own_process_and_streams_its_table",
    ),
    CudaBranch(
        "gpu_check/plan.py device_memory: a part's peak is its allocator's peak reservation plus the context"
        " measured alone",
        "none: the CPU has no device memory; an out-of-memory back-off inside a part is injected and fails it",
        "tests/distributed/test_gpu_check_backoff.py::test_a_backed_off_iteration_is_reported_and_fails",
    ),
)
