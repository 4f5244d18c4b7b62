"""The card the GPU check runs on: its memory and the budget every part is sized to, what one process's CUDA context
takes beyond its allocator, and its bf16 matrix-multiply rate, from which the check estimates each part's time.

On a GPU the card is read once, first, by a process alone on it (`measure_card`, spawned by the driver before any
part): its name and memory; the context, as the device memory in use once CUDA is initialised and nothing is
allocated (what every part's process holds outside its allocator: the driver's `context_gib`, added to a part's
`max_memory_reserved` for its own peak — never `mem_get_info`, which counts every process on the card); and the rate
of an 8192³ bf16 matrix product, timed after a warm-up. For a dry run the card is named (`--card h100|h200`, or the
CPU stand-in for the tiny parts): its memory from `GPU_SPECS`, the context and matrix rate assumed
(`ASSUMED_CONTEXT_GIB`, `ASSUMED_MATMUL_SHARE` of the spec's peak), so the CPU plans what the card would run.

The budget is the planner's: the card's memory less its `MARGIN` (H100 80 GB: 71.6 GiB; H200 141 GB: 126.4 GiB);
every part's planned peak must fit it, and parts run together only while their planned peaks together do."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1024**3
CARDS = {"h100": "h100-80gb", "h200": "h200-141gb"}  # --card NAME → cluster.gpu_type
ASSUMED_CONTEXT_GIB = 0.6  # CUDA 13 context + cuBLAS/cuDNN libraries of a torch process, before it allocates
ASSUMED_MATMUL_SHARE = 0.75  # an 8192³ bf16 product reaches ~0.7-0.8 of H100/H200's dense peak (989 TFLOP/s)
MATMUL_SIZE = 8192
MATMUL_REPEATS = 20


@dataclass(frozen=True)
class Card:
    name: str  # what the check prints: the device's name, or the named card of a dry run
    gpu_type: str  # its cluster.gpu_type (config/gpus.py)
    memory_gib: float
    context_gib: float  # one process's CUDA context outside its allocator
    matmul_tflops: float  # bf16 dense matrix products, TFLOP/s
    measured: bool  # read off the device (else named: assumed context and rate)

    @property
    def budget_gib(self) -> float:
        """What planned peaks must fit: the memory less the planner's margin."""
        from megatron_ppo.planner.plan import MARGIN

        return self.memory_gib * (1 - MARGIN)

    def describe(self) -> str:
        how = "measured" if self.measured else "assumed"
        return (f"{self.name}: {self.memory_gib:.1f} GiB, budget {self.budget_gib:.1f} GiB; context "
                f"{self.context_gib:.2f} GiB and bf16 matmul {self.matmul_tflops:.0f} TFLOP/s {how}")  # fmt: skip


def named_card(name: str) -> Card:
    """The card `name` (`CARDS`' keys, or `cpu`: the dry run's stand-in) as the specs describe it."""
    from megatron_ppo.config.gpus import gpu_spec

    gpu_type = CARDS.get(name, name)
    spec = gpu_spec(gpu_type)
    cpu = gpu_type == "cpu"
    rate = spec.peak_bf16_tflops * (1.0 if cpu else ASSUMED_MATMUL_SHARE)
    return Card(name=spec.description, gpu_type=gpu_type, memory_gib=spec.memory_gib,
                context_gib=0.0 if cpu else ASSUMED_CONTEXT_GIB, matmul_tflops=rate, measured=False)  # fmt: skip


def _measure(out: Path) -> None:
    """The measuring process (alone on the card): module docstring."""
    import torch

    from megatron_ppo.config.gpus import gpu_type_named

    torch.cuda.init()
    torch.empty(0, device="cuda")  # the context, nothing allocated
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    context = (total - free - torch.cuda.memory_reserved()) / GIB
    a, b = (torch.randn(MATMUL_SIZE, MATMUL_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(MATMUL_REPEATS):
        a @ b
    torch.cuda.synchronize()
    rate = 2 * MATMUL_SIZE**3 * MATMUL_REPEATS / (time.perf_counter() - started) / 1e12
    name = torch.cuda.get_device_name()
    card = Card(name=name, gpu_type=gpu_type_named(name), memory_gib=total / GIB, context_gib=context,
                matmul_tflops=rate, measured=True)  # fmt: skip
    out.write_text(json.dumps(asdict(card)))


def measure_card(work: Path) -> Card:
    """The card of this machine's first GPU, read by a spawned process alone on it (module docstring)."""
    out = work / "card.json"
    process = mp.get_context("spawn").Process(target=_measure, args=(out,), name="gpu-check card")
    process.start()
    process.join()
    if process.exitcode != 0 or not out.is_file():
        raise RuntimeError(f"reading the card failed (exit code {process.exitcode})")
    return Card(**json.loads(out.read_text()))
