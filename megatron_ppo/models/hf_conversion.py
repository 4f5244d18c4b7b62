"""Hugging Face (safetensors + config.json; Llama and Qwen2 families) ↔ Megatron GPT weights.

Megatron's fused layouts:
  linear_qkv  rows grouped per query group g: [q heads of g (a/g · d rows), k_g (d rows), v_g (d rows)], g = 0..G−1
  linear_fc1  [gate; up] (SwiGLU applies the activation to the first half)
  vocabulary  padded to `padded_vocab_size` rows (zeros); logits past the true vocabulary are masked downstream
Tensors are read one at a time from the safetensors files (`safe_open`), never through pickle; a tensor-parallel
rank reads only its rows or columns of each split weight.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_ppo.config.schema import ModelConfig

SUPPORTED = ("llama", "qwen2")


def model_config_from_hf(hf_dir: str | Path) -> dict:
    """Our `model.*` keys from a Hugging Face `config.json` (Llama or Qwen2)."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    kind = config.get("model_type")
    if kind not in SUPPORTED:
        raise ValueError(f"{hf_dir}: model_type {kind!r} is not supported; expected one of {SUPPORTED}")
    rope = config.get("rope_parameters") or {}
    return {
        "name": Path(hf_dir).name,
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "ffn_hidden_size": config["intermediate_size"],
        "num_attention_heads": config["num_attention_heads"],
        "num_query_groups": config.get("num_key_value_heads") or config["num_attention_heads"],
        "kv_channels": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "vocab_size": config["vocab_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "position_embedding_type": "rope",
        "rotary_base": float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        "normalization": "RMSNorm",
        "layernorm_epsilon": config["rms_norm_eps"],
        "activation": "swiglu",
        "add_qkv_bias": kind == "qwen2" or bool(config.get("attention_bias", False)),
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
    }


class SafetensorsReader:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, hf_dir: str | Path) -> None:
        self.bytes_read = 0  # what `get` has returned so far: a conversion rank reads only its own share
        hf_dir = Path(hf_dir)
        index = hf_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: hf_dir / file for name, file in weight_map.items()}
        else:
            single = hf_dir / "model.safetensors"
            with safe_open(str(single), framework="pt") as f:
                self.files = {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str, rows: slice = slice(None), columns: slice | None = None) -> torch.Tensor:
        """The tensor, or only its `rows` (and `columns`): a slice is read without loading the rest."""
        with safe_open(str(self.files[name]), framework="pt") as f:
            view = f.get_slice(name)
            tensor = view[rows] if columns is None else view[rows, columns]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor


@dataclass(frozen=True)
class TensorParallelPart:
    """Rank `rank` of `size` tensor-parallel ranks: which rows or columns of a split weight it holds."""

    size: int = 1
    rank: int = 0

    def of(self, length: int) -> slice:
        """This rank's contiguous share of `length` (which `size` divides)."""
        share = length // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


def _pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.nn.functional.pad(tensor, (0, 0, 0, rows - tensor.shape[0]))


def _vocab_rows(
    reader: SafetensorsReader, name: str, vocab: int, padded_vocab: int, part: TensorParallelPart
) -> torch.Tensor:
    """This rank's rows of the vocabulary-padded matrix: the real rows read, the padding rows zero."""
    rows = part.of(padded_vocab)
    real = reader.get(name, slice(min(rows.start, vocab), min(rows.stop, vocab)))
    return _pad_rows(real, rows.stop - rows.start)


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q; k; v] (HF) → per-group [q_g; k_g; v_g] rows (Megatron); works for weights and biases."""
    q, k, v = (t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _split_qkv(qkv: torch.Tensor, model: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups = model.num_query_groups or model.num_attention_heads
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    per_group = qkv.reshape(groups, -1, *qkv.shape[1:])
    q_rows = model.num_attention_heads // groups * head_dim
    q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, *qkv.shape[1:]), k.reshape(-1, *qkv.shape[1:]), v.reshape(-1, *qkv.shape[1:])


def hf_to_megatron(
    reader: SafetensorsReader,
    model: ModelConfig,
    padded_vocab: int,
    layers: Iterable[int] | None = None,
    embedding: bool = True,
    head: bool = True,
    part: TensorParallelPart = TensorParallelPart(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Megatron local-spec name, this TP rank's part of the tensor), one tensor at a time: the embedding, `layers`
    (default all), then the head (final norm, untied output layer). Only what is asked for is read, and of a
    tensor-parallel weight only `part`'s rows or columns: vocabulary rows (embedding, output layer), whole query
    groups of QKV, rows of gate and of up (fc1), columns of the row-parallel o_proj and down_proj."""
    groups = model.num_query_groups or model.num_attention_heads
    head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
    q_rows, kv_rows = model.num_attention_heads * head_dim, groups * head_dim
    ffn = model.ffn_hidden_size or 4 * model.hidden_size
    vocab = model.vocab_size
    if embedding:
        yield "embedding.word_embeddings.weight", _vocab_rows(reader, "model.embed_tokens.weight", vocab,
                                                              padded_vocab, part)  # fmt: skip
    for i in range(model.num_layers) if layers is None else layers:
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        attention = hf + "self_attn."
        yield mg + "input_layernorm.weight", reader.get(hf + "input_layernorm.weight")
        for suffix in ("weight", "bias") if model.add_qkv_bias else ("weight",):
            q, k, v = (reader.get(attention + f"{p}_proj.{suffix}", part.of(rows))
                       for p, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)))  # fmt: skip
            yield mg + f"self_attention.linear_qkv.{suffix}", _fuse_qkv(q, k, v, groups // part.size)
        yield mg + "self_attention.linear_proj.weight", reader.get(attention + "o_proj.weight", slice(None),
                                                                   part.of(q_rows))  # fmt: skip
        yield mg + "pre_mlp_layernorm.weight", reader.get(hf + "post_attention_layernorm.weight")
        gate, up = (reader.get(hf + f"mlp.{p}_proj.weight", part.of(ffn)) for p in ("gate", "up"))
        yield mg + "mlp.linear_fc1.weight", torch.cat([gate, up])
        yield mg + "mlp.linear_fc2.weight", reader.get(hf + "mlp.down_proj.weight", slice(None), part.of(ffn))
    if head:
        yield "decoder.final_layernorm.weight", reader.get("model.norm.weight")
        if model.untie_embeddings_and_output_weights:
            yield "output_layer.weight", _vocab_rows(reader, "lm_head.weight", vocab, padded_vocab, part)


def megatron_to_hf(state: dict[str, torch.Tensor], model: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of `hf_to_megatron` for a full (TP=1, PP=1) Megatron state dict; vocabulary padding dropped."""
    vocab = model.vocab_size
    out = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab]}
    for i in range(model.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        out[hf + "input_layernorm.weight"] = state[mg + "input_layernorm.weight"]
        for suffix in ("weight", "bias") if model.add_qkv_bias else ("weight",):
            q, k, v = _split_qkv(state[mg + f"self_attention.linear_qkv.{suffix}"], model)
            for name, tensor in zip("qkv", (q, k, v), strict=True):
                out[hf + f"self_attn.{name}_proj.{suffix}"] = tensor
        out[hf + "self_attn.o_proj.weight"] = state[mg + "self_attention.linear_proj.weight"]
        out[hf + "post_attention_layernorm.weight"] = state[mg + "pre_mlp_layernorm.weight"]
        gate, up = state[mg + "mlp.linear_fc1.weight"].chunk(2)
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = gate, up
        out[hf + "mlp.down_proj.weight"] = state[mg + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = state["decoder.final_layernorm.weight"]
    if model.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state["output_layer.weight"][:vocab]
    return {k: v.contiguous() for k, v in out.items()}


def save_hf(state: dict[str, torch.Tensor], out_dir: str | Path, hf_config_from: str | Path) -> None:
    """Write `model.safetensors` and copy `config.json` from the original checkpoint."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text((Path(hf_config_from) / "config.json").read_text())
