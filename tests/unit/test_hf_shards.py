"""The streaming safetensors writer against huggingface_hub's own `save_torch_state_dict`: the same files, index and
tensors, whatever order the tensors arrive in (one larger than a shard included), cast to the planned dtype; an
output that already holds files is refused, and a failed export leaves nothing behind."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import save_torch_state_dict
from safetensors import safe_open

from megatron_ppo.models.hf_shards import INDEX, ShardedSafetensorsWriter


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shapes = {"a": (8, 16), "big": (64, 32), "b": (16,), "c": (4, 4, 4), "d": (32, 8)}  # big: over a shard alone
    return {name: torch.randn(shape, generator=generator).to(dtype) for name, shape in shapes.items()}


def _read(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({name: f.get_tensor(name) for name in f.keys()})  # noqa: SIM118
    return out


def test_the_writer_gives_huggingface_hubs_files_in_any_order(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    expected = _tensors(torch.bfloat16)
    theirs.mkdir()
    save_torch_state_dict(expected, theirs, max_shard_size=600)
    planned = {name: (t.shape, torch.bfloat16) for name, t in expected.items()}
    (tmp_path / "config.json").write_text("{}")
    with ShardedSafetensorsWriter(ours, planned, tmp_path, max_shard_bytes=600) as writer:
        for name, tensor in reversed(_tensors(torch.float32).items()):  # cast on the way
            writer.write(name, tensor)
    assert sorted(p.name for p in ours.glob("*.safetensors")) == sorted(p.name for p in theirs.glob("*.safetensors"))
    assert len(writer.files) >= 3 and (ours / "config.json").is_file()
    index, reference = (json.loads((d / INDEX).read_text()) for d in (ours, theirs))
    assert index["weight_map"] == reference["weight_map"]
    assert index["metadata"] == {**reference["metadata"], "total_parameters": sum(t.numel() for t in expected.values())}
    written = _read(ours)
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert written[name].dtype == torch.bfloat16 and torch.equal(written[name], tensor), name


def test_one_shard_is_model_safetensors_without_an_index(tmp_path: Path) -> None:
    tensors = _tensors(torch.float32)
    with ShardedSafetensorsWriter(tmp_path / "out", {n: (t.shape, t.dtype) for n, t in tensors.items()}, tmp_path) as w:
        for name, tensor in tensors.items():
            w.write(name, tensor)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    assert all(torch.equal(_read(tmp_path / "out")[n], t) for n, t in tensors.items())


def test_a_failed_export_leaves_nothing_and_a_full_output_is_refused(tmp_path: Path) -> None:
    tensors = _tensors(torch.float32)
    planned = {name: (t.shape, t.dtype) for name, t in tensors.items()}
    writer = ShardedSafetensorsWriter(tmp_path / "out", planned, tmp_path, max_shard_bytes=3000)
    with pytest.raises(RuntimeError, match="4 planned tensors were never written"), writer:
        writer.write("a", tensors["a"])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="remove it or choose another output directory"):
        ShardedSafetensorsWriter(tmp_path / "out", planned, tmp_path)
