"""The conversion table on its own, without Megatron or processes: each tensor-parallel rank reads exactly its
share of the full Megatron tensor, and Megatron → Hugging Face gives back every Hugging Face tensor unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from megatron_ppo.convert import hf_model_config
from megatron_ppo.models.hf_conversion import (
    MAPPINGS,
    Kind,
    SafetensorsReader,
    Shapes,
    TensorParallelPart,
    hf_to_megatron,
    mapping_of,
    megatron_to_hf,
)
from tests.distributed.conversion_workers import save_hf_model


def _megatron_names(reader: SafetensorsReader, layers: int) -> list[str]:
    """The Megatron parameters of the checkpoint: every table row whose Hugging Face tensors it holds."""
    names = []
    for mapping in MAPPINGS:
        for layer in [str(i) for i in range(layers)] if "*" in mapping.megatron else [None]:
            if all(name in reader for name in mapping.hf_names(layer)):
                names.append(mapping.megatron.replace("*", layer) if layer else mapping.megatron)
    return names


def _rank_share(full: torch.Tensor, kind: Kind, part: TensorParallelPart) -> torch.Tensor:
    """Megatron's split of a full tensor: columns for row-parallel, [gate_r; up_r] for gate/up, rows otherwise."""
    if kind is Kind.REPLICATED:
        return full
    if kind is Kind.ROW:
        return full.chunk(part.size, dim=1)[part.rank]
    if kind is Kind.GATE_UP:
        return torch.cat([half.chunk(part.size)[part.rank] for half in full.chunk(2)])
    return full.chunk(part.size)[part.rank]


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False)])
def test_each_tp_rank_reads_its_share_and_the_way_back_is_exact(tmp_path: Path, kind: str, tied: bool) -> None:
    hf_dir = save_hf_model(kind, tmp_path, tied)
    model = hf_model_config(hf_dir)
    reader = SafetensorsReader(hf_dir)
    names = _megatron_names(reader, model.num_layers)
    shapes = Shapes.of(model, tensor_parallel_size=2)
    full = dict(hf_to_megatron(reader, names, shapes))
    for rank in range(2):
        part = TensorParallelPart(2, rank)
        for name, share in hf_to_megatron(reader, names, shapes, part):
            expected = _rank_share(full[name], mapping_of(name)[0].kind, part)
            assert torch.equal(share, expected), f"{kind}: TP rank {rank}'s {name} differs from its share"
    back = megatron_to_hf(full, model)
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        assert set(back) == set(f.keys()), f"{kind}: {set(back) ^ set(f.keys())}"
        for name in back:
            assert torch.equal(back[name], f.get_tensor(name)), f"{kind}: {name} changed on the way back"
