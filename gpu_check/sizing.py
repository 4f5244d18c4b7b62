"""Every part sized to the card it runs on, and its time estimated before it starts.

A part that builds a trainer plans its config with the planner (`megatron_ppo.planner.plan`, for the layers that
run: the check's GPU has no Transformer Engine, so the local spec, `model.transformer_impl=local`) and runs the
largest shape whose planned peak fits the card's budget (`card.Card.budget_gib`). Candidates come largest first in
this order of preference (`shrinking`): fewer rows in a micro-batch (or, for a part whose one micro-batch is the
whole mini-batch, fewer rows in it), then shorter rows (halved, down to `MIN_SEQ`), then fewer layers (halved) —
the 1.5B shape's width and vocabulary always kept. A part whose every candidate is over the budget is sized to the
smallest and marked as not fitting; the dry run for a card (`python -m gpu_check --dry-run --card h100`) fails then.

The estimate (`Sized.seconds`): the part's GPU work in FLOPs at `PASS_SHARE` of the card's measured matrix rate
(the share the first H200 run's (b) iteration reached), its bytes through host memory and the disk at
`HOST_GB_S` / `DISK_GB_S`, and its fixed costs stated per part (a process's start and imports, model builds, first
compiles: `FIXED_S`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from gpu_check.card import Card

MIN_SEQ = 256
# of the measured matmul rate: the first H200 run's (b) iteration, 64 × 1024 tokens in 12.63 s (MFU 14.4 %), is
# 0.18 of the ~750 TFLOP/s an 8192³ bf16 product reaches there
PASS_SHARE = 0.18
HOST_GB_S = 20.0  # pinned host ↔ device copies (PCIe 5: ~50 GB/s peak; offload copies many tensors of all sizes)
DISK_GB_S = 1.5  # a checkpoint's write and read (local NVMe through torch.distributed.checkpoint)
START_S = 12.0  # a spawned part's process: Python, torch, megatron-core and the package imported anew
# building one role of a billion parameters on the device (model, DDP buffers, optimizer): an assumption until a GPU
# run's (b) reports its `build_models_s`
BUILD_S_PER_BILLION = 5.0


@dataclass(frozen=True)
class PartShape:
    """What a part runs: `rows` rows (one iteration's batch, its one mini-batch) of `seq` tokens, `micro_batch` rows
    in every pass's micro-batch, `layers` layers of the shape's width and vocabulary."""

    rows: int
    seq: int
    micro_batch: int
    layers: int

    def describe(self) -> str:
        return f"{self.rows} rows × {self.seq} tokens, micro-batch {self.micro_batch}, {self.layers} layers"


@dataclass(frozen=True)
class Sized:
    """A part's shape on the card, its planned peak (GiB on the device, its process's context included) and what its
    time is estimated from."""

    shape: PartShape | None
    planned_gib: float
    fits: bool
    flops: float = 0.0
    transfer_gb: float = 0.0  # through host memory
    disk_gb: float = 0.0
    fixed_s: float = START_S
    tried: tuple[str, ...] = ()  # the larger shapes that did not fit, and their planned peaks

    def seconds(self, card: Card) -> float:
        """The estimated wall time of the part on `card` (module docstring)."""
        compute = self.flops / (card.matmul_tflops * 1e12 * PASS_SHARE)
        return self.fixed_s + compute + self.transfer_gb / HOST_GB_S + self.disk_gb / DISK_GB_S

    def describe(self) -> str:
        shape = self.shape.describe() if self.shape else "fixed shape"
        verdict = "" if self.fits else "  OVER THE BUDGET"
        return f"{shape}; planned {self.planned_gib:.1f} GiB{verdict}"


NEGLIGIBLE = Sized(shape=None, planned_gib=0.0, fits=True, fixed_s=0.0)


def halvings(value: int, smallest: int) -> list[int]:
    """`value`, its half, its quarter, … while at least `smallest` (always `value` itself)."""
    out = [value]
    while out[-1] // 2 >= smallest:
        out.append(out[-1] // 2)
    return out


def shrinking(base: PartShape, whole_mini_batch: bool = False, min_rows: int = 1) -> Iterator[PartShape]:
    """Candidates largest first (module docstring): for each layer count, each length, fewer rows — in a micro-batch,
    or with `whole_mini_batch` in the mini-batch that is one micro-batch (down to `min_rows` rows)."""
    for layers in halvings(base.layers, 2 if base.layers >= 2 else 1):
        for seq in halvings(base.seq, min(MIN_SEQ, base.seq)):
            if whole_mini_batch:
                for rows in halvings(base.rows, min_rows):
                    yield PartShape(rows=rows, seq=seq, micro_batch=rows, layers=layers)
            else:
                for micro in halvings(base.micro_batch, 1):
                    yield dataclasses.replace(base, seq=seq, micro_batch=micro, layers=layers)


def largest_fitting(
    card: Card, candidates: Iterator[PartShape], planned_gib: Callable[[PartShape], float],
    cost: Callable[[PartShape], Sized],
) -> Sized:  # fmt: skip
    """The first candidate whose `planned_gib` fits the card's budget, with `cost`'s estimate of it; else the last
    candidate, marked as not fitting."""
    tried: list[str] = []
    shape = None
    for shape in candidates:
        gib = planned_gib(shape)
        if gib <= card.budget_gib:
            return dataclasses.replace(cost(shape), planned_gib=gib, fits=True, tried=tuple(tried))
        tried.append(f"{shape.describe()}: {gib:.1f} GiB")
    assert shape is not None, "no candidate shape"
    return dataclasses.replace(cost(shape), planned_gib=gib, fits=False, tried=tuple(tried))


def iteration_flops(config) -> float:
    """FLOPs of one PPO iteration of `config` (experience and both updates), the planner's count."""
    from megatron_ppo.planner import flops

    tokens = config.data.train_batch_size * config.data.max_length
    roles = ("actor", "ref", "critic")
    params = {role: flops.flop_parameter_count(config.model, role) for role in roles}
    return sum(flops.iteration_flops(config, params, tokens, tokens * config.data.max_length).values())


def build_s(config) -> float:
    """Seconds to build and initialise the trainer's three roles on the device (`BUILD_S_PER_BILLION`)."""
    from megatron_ppo.planner.flops import parameter_count

    return 3 * BUILD_S_PER_BILLION * parameter_count(config.model) / 1e9
