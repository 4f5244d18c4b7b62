"""A Hugging Face checkpoint directory written tensor by tensor: safetensors shards planned before anything is written.

Every tensor's name, shape and dtype is known up front (from a distributed checkpoint's metadata), so the shard plan
is `huggingface_hub.split_torch_state_dict_into_shards` over meta tensors (Hugging Face's own greedy split, in the
order given, at most `max_shard_bytes` a file unless one tensor is larger), and each file's safetensors header (its
tensors' byte ranges) is written before its first tensor arrives. A tensor is then written at its place as soon as it
is converted and can be dropped: the writer holds no tensor, so the memory a conversion needs is what it converts at
once. The layout is Hugging Face's: one file is `model.safetensors` with no index; more are
`model-0000i-of-0000N.safetensors` with `model.safetensors.index.json` (`metadata.total_parameters`,
`metadata.total_size`, `weight_map`, as transformers writes it).

Everything is written into a sibling `.<name>.partial` directory and renamed to the output only once complete, so no
reader ever finds a half-written checkpoint under the output's name.
"""

from __future__ import annotations

import json
import shutil
import struct
from io import BufferedRandom
from pathlib import Path
from types import TracebackType

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from megatron_ppo.config.errors import UserError

INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # huggingface_hub's default ("5GB")


class OutputExistsError(UserError, FileExistsError):
    """A conversion's output directory holds files already: nothing is written over them."""


# Copied from the Hugging Face directory the model's config comes from, those that exist: what `from_pretrained`
# (model, generation and tokenizer) reads besides the weights.
COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")  # fmt: skip
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


class ShardedSafetensorsWriter:
    """Writes the tensors `planned` (name → (shape, dtype), in the order to shard them) into `out_dir`, each as
    `write` receives it, in any order; `close` (the end of a `with` block) checks that each was written, adds the
    index and `COPIED` from `copy_from`, and renames the result into place. An exception inside the block removes
    the partial directory. `out_dir` must not exist, or be empty."""

    def __init__(
        self,
        out_dir: str | Path,
        planned: dict[str, tuple[torch.Size, torch.dtype]],
        copy_from: str | Path,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    ) -> None:
        self.out_dir, self.copy_from = Path(out_dir), Path(copy_from)
        if self.out_dir.exists() and (not self.out_dir.is_dir() or any(self.out_dir.iterdir())):
            raise OutputExistsError(f"--out {self.out_dir} exists and is not an empty directory: remove it or choose "
                                    "another output directory")  # fmt: skip
        if unsupported := {dtype for _, dtype in planned.values()} - set(_DTYPES):
            raise ValueError(f"cannot write {sorted(map(str, unsupported))} to safetensors; expected {list(_DTYPES)}")
        meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in planned.items()}
        split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_bytes)
        self.files = list(split.filename_to_tensors)
        self.total_bytes: int = split.metadata["total_size"]
        self.index = {"metadata": {"total_parameters": sum(t.numel() for t in meta.values()), **split.metadata},
                      "weight_map": split.tensor_to_filename} if split.is_sharded else None  # fmt: skip
        self.partial = self.out_dir.parent / f".{self.out_dir.name}.partial"
        shutil.rmtree(self.partial, ignore_errors=True)  # left by an export that was killed
        self.partial.mkdir(parents=True)
        self._place: dict[str, tuple[str, int, torch.Size, torch.dtype]] = {}  # name → (file, byte offset, …)
        self._headers: dict[str, bytes] = {}
        self._left = {file: len(names) for file, names in split.filename_to_tensors.items()}
        self._open: dict[str, BufferedRandom] = {}
        for file, names in split.filename_to_tensors.items():
            header, offsets = _header({name: meta[name] for name in names})
            self._headers[file] = header
            for name in names:
                self._place[name] = (file, len(header) + offsets[name], meta[name].shape, meta[name].dtype)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the planned tensor `name` (cast to its planned dtype) at its place in its file."""
        if name not in self._place:
            raise KeyError(f"{name}: not planned, or written twice")
        file, offset, shape, dtype = self._place.pop(name)
        if tensor.shape != shape:
            raise ValueError(f"{name}: {tuple(tensor.shape)}, but {tuple(shape)} was planned")
        if file not in self._open:
            self._open[file] = (self.partial / file).open("w+b")
            self._open[file].write(self._headers[file])
        handle = self._open[file]
        handle.seek(offset)
        handle.write(tensor.detach().to(device="cpu", dtype=dtype).contiguous().reshape(-1).view(torch.uint8).numpy())
        self._left[file] -= 1
        if not self._left[file]:
            self._open.pop(file).close()

    def close(self) -> Path:
        """Finish: every planned tensor must have been written. Returns the output directory."""
        if self._place:
            shown = ", ".join(list(self._place)[:5])
            raise RuntimeError(f"{len(self._place)} planned tensors were never written ({shown}, …)")
        if self.index is not None:
            (self.partial / INDEX).write_text(json.dumps(self.index, indent=2, sort_keys=True) + "\n")
        for name in COPIED:
            if (self.copy_from / name).is_file():
                shutil.copyfile(self.copy_from / name, self.partial / name)
        if self.out_dir.is_dir():
            self.out_dir.rmdir()  # empty (checked at the start)
        self.partial.rename(self.out_dir)
        return self.out_dir

    def __enter__(self) -> ShardedSafetensorsWriter:
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, trace: TracebackType | None) -> None:
        try:
            if kind is None:
                self.close()
        finally:
            if self.partial.exists():  # not renamed into place: an error here or in the block
                for handle in self._open.values():
                    handle.close()
                shutil.rmtree(self.partial, ignore_errors=True)


def _header(tensors: dict[str, torch.Tensor]) -> tuple[bytes, dict[str, int]]:
    """A safetensors file's header for `tensors` laid out in order (8-byte little-endian length, then the JSON, padded
    with spaces to a multiple of 8 as safetensors pads it), and each tensor's byte offset after the header."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}  # transformers refuses files without a format
    offsets, end = {}, 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        entries[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [end, end + size]}
        offsets[name], end = end, end + size
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets
