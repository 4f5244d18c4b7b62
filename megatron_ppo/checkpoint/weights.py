"""A role's weights read from a checkpoint's files a layer at a time: no model, no process group.

A checkpoint (`store.py`) is a PyTorch distributed checkpoint (Megatron's `torch_dist` format) whose keys are
Megatron's sharded state dict names, global whatever TP/PP/EP saved it: the role's prefix (`actor.`), then
  embedding.word_embeddings.weight, decoder.final_layernorm.weight, output_layer.weight (untied)   [rows, h] / [h]
  decoder.layers.<name>                 every layer's tensor stacked on a first axis   [num_layers, *shape]
  decoder.layers.mlp.experts.experts.<name>   every expert's too (SequentialMLP and TEGroupedMLP alike)
                                              [num_layers, num_experts, *shape]
and layer norms under the names of Transformer Engine's fused modules (`self_attention.linear_qkv.layer_norm_weight`).
Anything else is skipped: Transformer Engine's `_extra_state` and other pickled objects, the optimizers' states
(`optimizer.state.*`, the distributed optimizer's buffers under `<role>.optimizer.distributed.`), the other roles.
The metadata gives every tensor's global shape and dtype without reading one; a group (one layer: each stacked tensor's
slice of that layer, all of its experts; or one tensor outside the layers) is read by `torch.distributed.checkpoint`
into buffers of that group's size, with the resharding DCP does for any saved layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_ppo.checkpoint.store import DISTRIBUTED_OPTIMIZER_KEY

_LAYERS, _EXPERTS = "decoder.layers.", "mlp.experts.experts."
_OUTSIDE = {"embedding.word_embeddings.weight": 0, "decoder.final_layernorm.weight": 2, "output_layer.weight": 3}


@dataclass(frozen=True)
class Weight:
    """One full-model (TP = 1, PP = 1, EP = 1) weight: its name as our conversion table spells it (the layer and
    expert numbers written in: `decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`), the checkpoint
    key holding it and its position on that tensor's stacked axes ((), (layer,) or (layer, expert))."""

    name: str
    key: str
    index: tuple[int, ...]
    shape: torch.Size
    dtype: torch.dtype


class CheckpointWeights:
    """The `role`'s weights in the distributed checkpoint at `path` (a `step_N` directory), grouped by layer.

    `groups`: the embedding, each layer in order, the final norm, the output layer (those present), each a list of
    `Weight`s. `read(group)` loads one group; `largest_group_bytes` is the most that one `read` has allocated."""

    def __init__(self, path: str | Path, role: str) -> None:
        self.path = Path(path)
        self._reader = dcp.FileSystemReader(str(self.path))
        self._metadata = self._reader.read_metadata().state_dict_metadata
        tensors = {key: md for key, md in self._metadata.items()
                   if isinstance(md, TensorStorageMetadata) and _is_weight(key, role)}  # fmt: skip
        if not tensors:
            raise ValueError(f"{self.path} holds no weights of the {role!r} role")
        # in Hugging Face's order: the embedding, layer by layer, the final norm, the output layer (then any other)
        groups: dict[tuple[int, int], list[Weight]] = {}
        for key, md in tensors.items():
            for weight in _weights(key, key.removeprefix(f"{role}."), md):
                place = (1, weight.index[0]) if weight.index else (_OUTSIDE.get(weight.name, len(_OUTSIDE) + 1), 0)
                groups.setdefault(place, []).append(weight)
        self.groups: list[list[Weight]] = [groups[place] for place in sorted(groups)]
        self.num_layers = sum(rank == 1 for rank, _ in groups)
        self.largest_group_bytes = 0

    def weights(self) -> Iterator[Weight]:
        for group in self.groups:
            yield from group

    def read(self, group: list[Weight], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Full-model name → tensor of each weight in `group` (in `dtype`, by default the checkpoint's), read from
        the files: of a stacked tensor only this layer's slice (all of its experts)."""
        regions: dict[str, tuple[torch.Size, torch.Tensor]] = {}
        for weight in group:
            if weight.key not in regions:
                stacked = weight.index[:1]  # the layer; a layer's experts are read together
                size = self._metadata[weight.key].size
                offsets = torch.Size([*stacked, *[0] * (len(size) - len(stacked))])
                buffer = torch.empty([1] * len(stacked) + list(size[len(stacked) :]), dtype=dtype or weight.dtype)
                regions[weight.key] = (offsets, buffer)
        self.largest_group_bytes = max(self.largest_group_bytes,
                                       sum(b.numel() * b.element_size() for _, b in regions.values()))  # fmt: skip
        with warnings.catch_warnings():  # one process reads on purpose: DCP's notice that no process group is used
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            dcp.load({key: buffer for key, (_, buffer) in regions.items()}, storage_reader=self._reader,
                     planner=_RegionPlanner(regions), no_dist=True)  # fmt: skip
        return {weight.name: regions[weight.key][1][(0, *weight.index[1:])] if weight.index else regions[weight.key][1]
                for weight in group}  # fmt: skip


def _is_weight(key: str, role: str) -> bool:
    return key.startswith(f"{role}.") and not key.startswith(f"{role}.{DISTRIBUTED_OPTIMIZER_KEY}")


def _weights(key: str, name: str, md: TensorStorageMetadata) -> list[Weight]:
    """The full-model weights the checkpoint tensor `key` (`name` without the role's prefix) holds."""
    if not name.startswith(_LAYERS):
        return [Weight(name, key, (), md.size, md.properties.dtype)]
    rest = name.removeprefix(_LAYERS)
    if rest.startswith(_EXPERTS):
        rest = rest.removeprefix(_EXPERTS)
        return [Weight(f"{_LAYERS}{layer}.mlp.experts.local_experts.{expert}.{rest}", key, (layer, expert),
                       md.size[2:], md.properties.dtype)
                for layer in range(md.size[0]) for expert in range(md.size[1])]  # fmt: skip
    return [Weight(f"{_LAYERS}{layer}.{rest}", key, (layer,), md.size[1:], md.properties.dtype)
            for layer in range(md.size[0])]  # fmt: skip


class _RegionPlanner(DefaultLoadPlanner):
    """DCP's default planner, asking of each checkpoint tensor only the region its buffer stands for: `regions` maps
    a key to (the region's offsets in the global tensor, the buffer of the region's size)."""

    def __init__(self, regions: dict[str, tuple[torch.Size, torch.Tensor]]) -> None:
        super().__init__()
        self.regions = regions

    def create_local_plan(self) -> LoadPlan:
        chunks = {key: ChunkStorageMetadata(offsets=offsets, sizes=buffer.size())
                  for key, (offsets, buffer) in self.regions.items()}  # fmt: skip
        return LoadPlan([item for key, chunk in chunks.items()
                         for item in create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key],
                                                                      [chunk])])  # fmt: skip

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.regions[index.fqn][1]
