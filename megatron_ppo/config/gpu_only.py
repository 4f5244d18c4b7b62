"""The one list of what cannot run on CPU: each setting with its reason and the `make gpu-check` part that runs it.

Validation refuses each on `cluster.device=cpu` (`validate.py` reads this list); the README's table is this list;
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
