"""No host read inside the layers for a packed micro-batch: its forward and backward through the layers make no
device→host read (each a blocking sync on a GPU, where the host could otherwise run ahead), counted at the Python
level (`.tolist()`, `.cpu()`, `.numpy()`) and at dispatch (`.item()`, `bool()` / `int()` of a tensor, `nonzero`,
`equal`, …, forward and backward). Megatron's own THD RoPE, put back, reads `cu_seqlens` on the host in every layer:
the count sees it (`megatron_compat.rotary_per_token` is what removes it), and its outputs equal ours."""

from __future__ import annotations

import torch

from tests.distributed import packed_layer_workers
from tests.distributed.harness import run_distributed


def test_a_packed_micro_batch_reads_nothing_on_the_host_inside_the_layers() -> None:
    (report,) = run_distributed(packed_layer_workers.host_reads_of_a_packed_micro_batch, 1)
    ours, megatron = report["package"], report["megatron thd rope"]
    assert ours["reads"] == [], f"host reads inside the layers, forward and backward: {ours['reads']}"
    layers = 4
    assert len(megatron["reads"]) >= 2 * 2 * layers, f"Megatron's THD RoPE read the host only {megatron['reads']}"
    real = report["real"]
    assert torch.equal(ours["logits"][0, real], megatron["logits"][0, real]), "the rotations differ"
