"""The conversion table on its own, without Megatron models or processes: each tensor-parallel rank reads exactly
its share of the full Megatron tensor (of an expert, its expert-tensor-parallel share) as Megatron's own
initialisation cuts it, and Megatron → Hugging Face gives back every Hugging Face tensor unchanged."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu
from safetensors import safe_open

from megatron_ppo.convert.huggingface import hf_model_config
from megatron_ppo.models.hf_conversion import (
    MAPPINGS,
    Kind,
    SafetensorsReader,
    Shapes,
    TensorParallelPart,
    hf_to_megatron,
    mapping_of,
    to_hf,
)
from tests.support.hf_models import save_hf_model


def _megatron_names(reader: SafetensorsReader, layers: int, experts: int) -> list[str]:
    """The Megatron parameters of the checkpoint: every table row whose Hugging Face tensors it holds, its `*`s
    standing for each layer (and each expert)."""
    names = []
    for mapping in MAPPINGS:
        numbers = [range(layers), range(experts)][: mapping.megatron.count("*")]
        for indices in itertools.product(*([str(i) for i in n] for n in numbers)):
            if all(name in reader for name in mapping.hf_names(indices)):
                names.append(mapping.megatron_name(indices))
    return names


def _rank_share(full: torch.Tensor, kind: Kind, part: TensorParallelPart) -> torch.Tensor:
    """The rank's share as Megatron itself cuts a full ("master") weight: `_initialize_affine_weight_cpu`, what its
    Column/RowParallelLinear and VocabParallelEmbedding run under `use_cpu_initialization` — split along the
    partition dimension (1 for row-parallel, 0 otherwise; a vector as one column), rank r taking parts r, r + TP, …
    of `stride` × TP; the fused gate/up of SwiGLU with stride 2 ([gate_r; up_r]: the local layout Megatron's
    `glu` halves in the forward and its checkpoint factory `apply_swiglu_sharded_factory` writes)."""
    if kind is Kind.REPLICATED:
        return full
    matrix = full if full.dim() == 2 else full.view(-1, 1)
    rows, columns = matrix.shape
    dim = 1 if kind is Kind.ROW else 0
    per_rank = (columns if dim else rows) // part.size
    share = torch.empty((rows, per_rank) if dim else (per_rank, columns), dtype=matrix.dtype)
    _initialize_affine_weight_cpu(
        share, rows, columns, per_rank, dim, lambda master: master.copy_(matrix),
        stride=2 if kind is Kind.GATE_UP else 1, params_dtype=matrix.dtype, rank=part.rank, world_size=part.size,
    )  # fmt: skip
    return share.view(-1) if full.dim() == 1 else share


@pytest.mark.parametrize(("kind", "tied"), [("llama", False), ("qwen2", True), ("qwen3", False), ("qwen3_moe", False)])
def test_each_tp_rank_reads_its_share_and_the_way_back_is_exact(tmp_path: Path, kind: str, tied: bool) -> None:
    hf_dir = save_hf_model(kind, tmp_path, tied)
    model = hf_model_config(hf_dir)
    reader = SafetensorsReader(hf_dir)
    names = _megatron_names(reader, model.num_layers, model.num_experts)
    if kind == "qwen3_moe":  # the router and each expert's two weights in both Megatron namings (local and TE)
        assert sum(".experts." in n for n in names) == model.num_layers * model.num_experts * 2 * 2
        assert sum(n.endswith("mlp.router.weight") for n in names) == model.num_layers
    shapes = Shapes.of(model, tensor_parallel_size=2)
    full = dict(hf_to_megatron(reader, names, shapes))
    for rank, expert_tp in itertools.product(range(2), (1, 2)):
        part, expert_part = TensorParallelPart(2, rank), TensorParallelPart(expert_tp, rank % expert_tp)
        for name, share in hf_to_megatron(reader, names, shapes, part, expert_part):
            mapping = mapping_of(name)[0]
            expected = _rank_share(full[name], mapping.kind, expert_part if mapping.expert else part)
            assert torch.equal(share, expected), f"{kind}: TP rank {rank}'s {name} differs from its share"
    whole = Shapes.of(model)
    back = {hf: part for name, tensor in full.items() for hf, part in to_hf(name, tensor, whole)}
    with safe_open(str(hf_dir / "model.safetensors"), framework="pt") as f:
        assert set(back) == set(f.keys()), f"{kind}: {set(back) ^ set(f.keys())}"
        for name in back:
            assert torch.equal(back[name], f.get_tensor(name)), f"{kind}: {name} changed on the way back"
