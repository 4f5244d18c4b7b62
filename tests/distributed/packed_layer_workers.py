"""Spawned-rank code for the host-read test of a packed micro-batch: its forward and backward through the layers
counted for the operations that read the device on a GPU (a host sync each)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer import attention as megatron_attention
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models import build_role_model, unwrap
from megatron_ppo.models.packing import build_pack
from megatron_ppo.parallel import init_distributed
from tests.distributed.workers import MODEL

aten = torch.ops.aten
# aten operations whose result a GPU must hand the host before the call returns: a scalar read (`.item()`, `int()`,
# `bool()` of a tensor), a data-dependent output size, a comparison answered as a Python bool
READS_AT_DISPATCH = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.equal, aten.is_nonzero,
                     aten._unique2, aten.unique_consecutive, aten.unique_dim}  # fmt: skip
# Tensor methods that copy to the host without an aten operation of their own on a CPU tensor
READS_AT_PYTHON = {"tolist", "numpy", "cpu"}


class HostReads(TorchFunctionMode):
    """Counts the device→host reads of the code run while `counting`: Tensor methods at the Python level (this mode)
    and aten operations at dispatch (`_Dispatch`, which also sees the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.counting = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.counting and getattr(func, "__name__", "") in READS_AT_PYTHON:
            self.reads.append(f"Tensor.{func.__name__}")
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.host = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.host.counting and func.overloadpacket in READS_AT_DISPATCH:
            self.host.reads.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads_in(decoder: torch.nn.Module) -> Iterator[HostReads]:
    """The host reads of `decoder`'s forwards (the layers) and of every backward run inside the block."""
    reads = HostReads()
    start = decoder.register_forward_pre_hook(lambda *_: setattr(reads, "counting", True))
    stop = decoder.register_forward_hook(lambda *_: setattr(reads, "counting", False))
    try:
        with reads, _Dispatch(reads):
            yield reads
    finally:
        start.remove()
        stop.remove()


def host_reads_of_a_packed_micro_batch(rank: int, world_size: int) -> dict[str, Any]:
    """The parity model (RoPE, grouped queries, 4 layers) packed: one micro-batch's forward and backward through
    the layers, on the package's path and with Megatron's own THD RoPE put back; the outputs of both and the
    host reads each made inside the layers."""
    init_distributed(MegatronConfig(), seed=0)
    model = dataclasses.replace(MODEL, pack_sequences=True)
    actor = build_role_model("actor", model, MegatronConfig())
    chunk, gpt = actor.chunks[0], unwrap(actor.chunks[0])
    pack = build_pack([5, 9, 3, 7], row_width=9, multiple=1, width=26)  # a tail, as a pipeline pass's shape adds
    rows = torch.randint(1, model.vocab_size, (4, 9), generator=torch.Generator().manual_seed(0))
    report: dict[str, Any] = {"real": pack.token_is_real[0]}
    for path in ("package", "megatron thd rope"):
        if path == "megatron thd rope":  # the attention module's RoPE as Megatron ships it
            megatron_attention.apply_rotary_pos_emb = rope_utils.apply_rotary_pos_emb
        chunk.zero_grad_buffer()
        with host_reads_in(gpt.decoder) as reads:
            logits = chunk(pack.pack(rows), pack.position_ids, None, packed_seq_params=pack.params)
            reads.counting = True  # the backward: through the layers (and the output layer, which reads nothing)
            logits.float().square().mean().backward()
            reads.counting = False
        report[path] = {"reads": reads.reads, "logits": logits.detach()}
    return report
