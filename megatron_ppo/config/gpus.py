"""The GPU types a cluster may name (`cluster.gpu_type`), and the one table of what the project assumes about each:
the planner's memory budget and step time (`planner/plan.py`), the measured MFU's peak (`train/throughput.py`) and
the GPU check (`gpu_check/__main__.py`) all read `GPU_SPECS`; nothing else states these numbers.

    peak_bf16_tflops   dense bf16 tensor-core peak, TFLOP/s (no sparsity): H100/H200 SXM 989, A100 312
    memory_gib         device memory, GiB, as nvidia-smi reports its total (H100 SXM 81559 MiB, H200 143771 MiB,
                       A100 SXM 80 GB 81920 MiB); the planner keeps a margin of it free
    assumed_mfu        model-FLOPs utilisation of PPO's passes, calibrated in docs/planner.md ("Calibration"):
                       Megatron-LM pretraining reaches 42–47 % on H100 and 44 % on A100, verl's Megatron actor update
                       31–40 %; RL passes (short, variable-length micro-batches, three models) keep about 0.8 of it.
                       H200 has H100's tensor cores: the same MFU (its faster memory is not counted)
    all_to_all_gb_s    (within a node over NVLink, across nodes over InfiniBand) GB/s per GPU assumed for the MoE
                       token all-to-all: about half the links' unidirectional peaks (H100/H200 NVLink 450, A100 300;
                       one 400 or 200 Gb/s NIC per GPU), as all-to-all of small messages reaches; not calibrated
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSpec:
    """What the project assumes about one GPU type (module docstring: the meaning and source of each number)."""

    description: str
    device_name: str | None  # what torch.cuda.get_device_name() contains for it (None: not a CUDA device)
    peak_bf16_tflops: float
    memory_gib: float
    assumed_mfu: float
    all_to_all_gb_s: tuple[float, float]  # (within a node, across nodes)
    mfu_anchor: str  # where assumed_mfu comes from, printed by the planner


GPU_SPECS: dict[str, GpuSpec] = {
    "h100-80gb": GpuSpec(
        "NVIDIA H100 80 GB SXM", "H100", 989.0, 79.6, 0.35, (200.0, 40.0),
        "anchors: Megatron-LM pretraining 42-47 % (7-70B, H100), verl actor update 31-40 %",
    ),
    "h200-141gb": GpuSpec(
        "NVIDIA H200 141 GB SXM", "H200", 989.0, 140.4, 0.35, (200.0, 40.0),
        "H100's tensor cores: H100's anchors (Megatron-LM pretraining 42-47 %, verl actor update 31-40 %)",
    ),
    "a100-80gb": GpuSpec(
        "NVIDIA A100 80 GB SXM", "A100", 312.0, 80.0, 0.35, (120.0, 20.0),
        "anchor: Megatron-LM pretraining 44 % (175B, 1024 A100)",
    ),
    "cpu": GpuSpec(
        "a CPU process standing in for a GPU (gloo)", None, 1.0, 8.0, 0.1, (1.0, 1.0),
        "a nominal figure: CPU runs are for correctness, not speed",
    ),
}  # fmt: skip


def gpu_spec(gpu_type: str) -> GpuSpec:
    """The spec of `gpu_type`; an unknown type is an error naming the known ones (validation refuses it earlier)."""
    try:
        return GPU_SPECS[gpu_type]
    except KeyError:
        raise KeyError(f"cluster.gpu_type={gpu_type!r} is not one of {', '.join(GPU_SPECS)}") from None


def gpu_type_named(device_name: str) -> str:
    """The `cluster.gpu_type` of a CUDA device called `device_name` (torch.cuda.get_device_name()); a device none of
    the specs names is an error listing them (add its row to GPU_SPECS)."""
    for gpu_type, spec in GPU_SPECS.items():
        if spec.device_name is not None and spec.device_name in device_name:
            return gpu_type
    raise ValueError(f"no GPU spec for {device_name!r}: GPU_SPECS (megatron_ppo/config/gpus.py) knows "
                     f"{', '.join(GPU_SPECS)}; add a row with its peak, memory and assumed MFU")  # fmt: skip
