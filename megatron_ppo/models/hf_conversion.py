"""Hugging Face (safetensors + config.json) ↔ Megatron GPT weights, driven by one mapping table.

Each row of `MAPPINGS` names a Megatron parameter, the Hugging Face tensor(s) it is made of and its `Kind`; the kind
says how the tensors combine and how tensor parallelism splits them, in both directions:
  replicated  norms: every TP rank holds the whole tensor
  row         row-parallel linears (o_proj, down_proj): TP rank r holds columns [r·n/TP, (r+1)·n/TP)
  qkv         linear_qkv, rows grouped per query group g: [q heads of g (a/G · d rows); k_g (d rows); v_g (d rows)],
              g = 0..G−1; TP rank r holds whole groups [r·G/TP, (r+1)·G/TP) (weights and biases alike)
  gate_up     linear_fc1 = [gate; up] (SwiGLU activates the first half); TP rank r holds its rows of each half
  vocab       embedding and output layer, padded with zero rows to `padded_vocab`; TP rank r holds its rows
              (logits past the true vocabulary are masked downstream)
A `*` in a name stands for a number: the layer, then (in expert rows) the global expert e = 0..E−1. Expert rows
(Qwen3-MoE's `mlp.experts.{e}.gate_proj/up_proj/down_proj`, as Megatron's SequentialMLP `local_experts.{e}` on CPU or
TEGroupedMLP `weight{e}` on GPU) are split by the expert-tensor-parallel size instead of TP, and an expert-parallel
rank holds experts [r·E/EP, (r+1)·E/EP) only (the converter names them by their global number).
A conversion is driven by the Megatron parameters a shard holds: each is looked up in the table, so an architecture
adds rows, not functions. Tensors are read one at a time from the safetensors files (`safe_open`), never through
pickle, and of a split weight a TP rank reads only its own rows or columns (`get_slice`); an EP rank reads only its
own experts.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.hf_rope import hf_rope_scaling
from megatron_ppo.config.schema import ModelConfig
from megatron_ppo.models.transformer_config import padded_vocab_size


class Kind(enum.Enum):
    REPLICATED = "replicated"
    ROW = "row"
    QKV = "qkv"
    GATE_UP = "gate_up"
    VOCAB = "vocab"


@dataclass(frozen=True)
class Mapping:
    """One Megatron parameter and the Hugging Face tensors it is made of; each `*` stands for a number (the layer,
    then the expert), in the same order in both names."""

    megatron: str
    hf: tuple[str, ...]  # one name, or the parts fused in order: (q, k, v) or (gate, up)
    kind: Kind
    expert: bool = False  # split by the expert-tensor-parallel size (instead of TP)

    def hf_names(self, indices: Sequence[str] = ()) -> tuple[str, ...]:
        """The Hugging Face names with the `*`s replaced by `indices` in order."""
        return tuple(_fill(name, indices) for name in self.hf)

    def megatron_name(self, indices: Sequence[str] = ()) -> str:
        return _fill(self.megatron, indices)


def _fill(pattern: str, indices: Sequence[str]) -> str:
    for index in indices:
        pattern = pattern.replace("*", index, 1)
    return pattern


_HF, _MG = "model.layers.*.", "decoder.layers.*."
_HF_EXPERT = _HF + "mlp.experts.*."
MAPPINGS: tuple[Mapping, ...] = (
    Mapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), Kind.VOCAB),
    Mapping(_MG + "input_layernorm.weight", (_HF + "input_layernorm.weight",), Kind.REPLICATED),
    *(
        Mapping(_MG + f"self_attention.linear_qkv.{p}", tuple(_HF + f"self_attn.{x}_proj.{p}" for x in "qkv"), Kind.QKV)
        for p in ("weight", "bias")  # the bias: Qwen2
    ),
    Mapping(_MG + "self_attention.q_layernorm.weight", (_HF + "self_attn.q_norm.weight",), Kind.REPLICATED),  # Qwen3
    Mapping(_MG + "self_attention.k_layernorm.weight", (_HF + "self_attn.k_norm.weight",), Kind.REPLICATED),  # Qwen3
    Mapping(_MG + "self_attention.linear_proj.weight", (_HF + "self_attn.o_proj.weight",), Kind.ROW),
    Mapping(_MG + "pre_mlp_layernorm.weight", (_HF + "post_attention_layernorm.weight",), Kind.REPLICATED),
    Mapping(_MG + "mlp.linear_fc1.weight", (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight"), Kind.GATE_UP),
    Mapping(_MG + "mlp.linear_fc2.weight", (_HF + "mlp.down_proj.weight",), Kind.ROW),
    Mapping("decoder.final_layernorm.weight", ("model.norm.weight",), Kind.REPLICATED),
    Mapping("output_layer.weight", ("lm_head.weight",), Kind.VOCAB),  # untied embeddings only
    # Transformer Engine's layer spec (GPU) fuses the two layer norms into the linear layer that follows each, and
    # its parameters carry these names (the CPU tests build the local spec only).
    Mapping(_MG + "self_attention.linear_qkv.layer_norm_weight", (_HF + "input_layernorm.weight",), Kind.REPLICATED),
    Mapping(_MG + "mlp.linear_fc1.layer_norm_weight", (_HF + "post_attention_layernorm.weight",), Kind.REPLICATED),
    # Mixture of experts (Qwen3-MoE): the router (fp32 in Megatron), then each expert as a gated MLP, named as
    # Megatron's SequentialMLP (the local spec) or TEGroupedMLP (TE's grouped GEMM) holds it.
    Mapping(_MG + "mlp.router.weight", (_HF + "mlp.gate.weight",), Kind.REPLICATED),
    *(
        Mapping(_MG + fc1, (_HF_EXPERT + "gate_proj.weight", _HF_EXPERT + "up_proj.weight"), Kind.GATE_UP, expert=True)
        for fc1 in ("mlp.experts.local_experts.*.linear_fc1.weight", "mlp.experts.linear_fc1.weight*")
    ),
    *(
        Mapping(_MG + fc2, (_HF_EXPERT + "down_proj.weight",), Kind.ROW, expert=True)
        for fc2 in ("mlp.experts.local_experts.*.linear_fc2.weight", "mlp.experts.linear_fc2.weight*")
    ),
)
_PATTERNS = {re.compile(re.escape(m.megatron).replace(r"\*", r"(\d+)")): m for m in MAPPINGS}


def mapping_of(megatron_name: str) -> tuple[Mapping, tuple[str, ...]]:
    """The table row of a full-model Megatron parameter name, and the numbers its `*`s stand for (layer, expert)."""
    for pattern, mapping in _PATTERNS.items():
        if match := pattern.fullmatch(megatron_name):
            return mapping, match.groups()
    raise KeyError(f"{megatron_name}: no row in the conversion table (megatron_ppo.models.hf_conversion.MAPPINGS)")


@dataclass(frozen=True)
class Family:
    """What a Hugging Face `model_type` sets on top of the Llama layout (RMSNorm, SwiGLU, RoPE, GQA)."""

    add_qkv_bias: bool
    qk_layernorm: bool = False
    moe: bool = False  # every layer's MLP is a mixture of experts (Qwen3-MoE)


FAMILIES = {
    "llama": Family(add_qkv_bias=False),
    "qwen2": Family(add_qkv_bias=True),
    "qwen3": Family(add_qkv_bias=False, qk_layernorm=True),
    "qwen3_moe": Family(add_qkv_bias=False, qk_layernorm=True, moe=True),
}
# config.json keys that add tensors or change the layout beyond what Megatron's GPT and the table express.
_REFUSED = {"attention_bias": True, "mlp_bias": True, "use_sliding_window": True}


def _moe_keys(config: dict) -> tuple[dict, list[str]]:
    """Our mixture-of-experts `model.*` keys from a Qwen3-MoE config.json, and what the conversion cannot express:
    dense layers between the MoE ones (`mlp_only_layers`, `decoder_sparse_step` > 1)."""
    problems = []
    if config.get("mlp_only_layers"):
        problems.append(f"mlp_only_layers={config['mlp_only_layers']!r} is not supported (every layer must be MoE)")
    if config.get("decoder_sparse_step", 1) != 1:
        problems.append(f"decoder_sparse_step={config['decoder_sparse_step']!r} is not supported (expected 1: every "
                        "layer MoE)")  # fmt: skip
    keys = {
        # published checkpoints write num_experts; transformers 5 writes its attribute name num_local_experts
        "num_experts": config.get("num_experts") or config["num_local_experts"],
        "num_experts_per_tok": config["num_experts_per_tok"],
        "moe_intermediate_size": config["moe_intermediate_size"],
        "norm_topk_prob": config.get("norm_topk_prob", False),  # transformers' default
    }
    return keys, problems


HF_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def hf_params_dtype(hf_dir: str | Path) -> str | None:
    """Our `model.params_dtype` for the dtype a Hugging Face `config.json` says its weights are in (`torch_dtype`,
    `dtype` in newer transformers); None where it says none we know."""
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    return HF_DTYPES.get(str(config.get("torch_dtype") or config.get("dtype")))


def model_config_from_hf(hf_dir: str | Path) -> dict:
    """Our `model.*` keys from a Hugging Face `config.json` (Llama, Qwen2, Qwen3, Qwen3-MoE); a `ConfigError` naming
    the key where the checkpoint needs what the conversion cannot express. The router's aux-loss coefficient is a
    training setting, not architecture: it is left to the recipe."""
    source = str(Path(hf_dir) / "config.json")
    if not Path(source).is_file():
        raise ConfigError([f"{hf_dir} holds no config.json: expected a Hugging Face model directory (config.json and "
                           "*.safetensors, as `save_pretrained` writes it)"], source)  # fmt: skip
    try:
        config = json.loads(Path(source).read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ConfigError([f"it is not valid JSON ({error}): expected a Hugging Face config.json"], source) from None
    kind = config.get("model_type")
    if kind not in FAMILIES:
        raise ConfigError([f"model_type {kind!r} is not supported; expected one of {tuple(FAMILIES)}"], source)
    family = FAMILIES[kind]
    rope_scaling_factor, problems = hf_rope_scaling(config)
    problems += [f"{key}={config[key]!r} is not supported by the conversion (megatron-ppo converts {kind} with "
                 f"{key}={not value})" for key, value in _REFUSED.items() if config.get(key) == value]  # fmt: skip
    moe, moe_problems = _moe_keys(config) if family.moe else ({}, [])
    problems += moe_problems
    if problems:
        raise ConfigError(problems, source)
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
        "rope_scaling_factor": rope_scaling_factor,
        "normalization": "RMSNorm",
        "layernorm_epsilon": config["rms_norm_eps"],
        "activation": "swiglu",
        "add_qkv_bias": family.add_qkv_bias,
        "qk_layernorm": family.qk_layernorm,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        **moe,
    }


@dataclass(frozen=True)
class Shapes:
    """The sizes the table's kinds need beyond the tensors' own shapes, derived once from the model config (and the
    TP size, for the vocabulary padding)."""

    heads: int
    groups: int  # query groups = key/value heads
    head_dim: int
    vocab: int
    padded_vocab: int

    @classmethod
    def of(cls, model: ModelConfig, tensor_parallel_size: int = 1) -> Shapes:
        return cls(
            heads=model.num_attention_heads,
            groups=model.num_query_groups or model.num_attention_heads,
            head_dim=model.kv_channels or model.hidden_size // model.num_attention_heads,
            vocab=model.vocab_size,
            padded_vocab=padded_vocab_size(model, tensor_parallel_size),
        )

    @property
    def q_rows(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.groups * self.head_dim


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
            if not single.is_file():
                raise ConfigError([f"{hf_dir} holds neither model.safetensors nor model.safetensors.index.json: "
                                   "expected the weights as safetensors"])  # fmt: skip
            try:
                with safe_open(str(single), framework="pt") as f:
                    self.files = {name: single for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
            except Exception as error:  # safetensors' own SafetensorError, or an OSError
                raise ConfigError([f"{single} cannot be read as safetensors ({error}): the file is damaged; "
                                   "download it again"]) from None  # fmt: skip

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def shape(self, name: str) -> list[int]:
        """The tensor's shape, from the file header (nothing is read)."""
        with safe_open(str(self.files[name]), framework="pt") as f:
            return f.get_slice(name).get_shape()

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


Part = TensorParallelPart


def _read_replicated(reader: SafetensorsReader, names: tuple[str, ...], s: Shapes, part: Part) -> torch.Tensor:
    return reader.get(names[0])


def _read_row(reader: SafetensorsReader, names: tuple[str, ...], s: Shapes, part: Part) -> torch.Tensor:
    """This rank's columns of a row-parallel [out, in] weight."""
    return reader.get(names[0], slice(None), part.of(reader.shape(names[0])[1]))


def _read_qkv(reader: SafetensorsReader, names: tuple[str, ...], s: Shapes, part: Part) -> torch.Tensor:
    """The q, k, v rows of this rank's query groups (HF: [q; k; v]) → per-group [q_g; k_g; v_g] rows (Megatron)."""
    rows = (s.q_rows, s.kv_rows, s.kv_rows)
    q, k, v = (reader.get(name, part.of(n)) for name, n in zip(names, rows, strict=True))
    q, k, v = (t.reshape(s.groups // part.size, -1, *t.shape[1:]) for t in (q, k, v))
    return torch.cat([q, k, v], dim=1).flatten(0, 1)


def _read_gate_up(reader: SafetensorsReader, names: tuple[str, ...], s: Shapes, part: Part) -> torch.Tensor:
    """[this rank's rows of gate; this rank's rows of up]."""
    return torch.cat([reader.get(name, part.of(reader.shape(name)[0])) for name in names])


def _read_vocab(reader: SafetensorsReader, names: tuple[str, ...], s: Shapes, part: Part) -> torch.Tensor:
    """This rank's rows of the padded [padded_vocab, h] matrix: the real rows read, the padding rows zero."""
    rows = part.of(s.padded_vocab)
    real = reader.get(names[0], slice(min(rows.start, s.vocab), min(rows.stop, s.vocab)))
    return torch.nn.functional.pad(real, (0, 0, 0, rows.stop - rows.start - real.shape[0]))


def _split_qkv(qkv: torch.Tensor, s: Shapes) -> tuple[torch.Tensor, ...]:
    """Per-group [q_g; k_g; v_g] rows → (q, k, v) with HF's row order."""
    per_group = qkv.reshape(s.groups, -1, *qkv.shape[1:])
    parts = per_group.split([s.q_rows // s.groups, s.head_dim, s.head_dim], dim=1)
    return tuple(t.flatten(0, 1) for t in parts)


READ: dict[Kind, Callable[[SafetensorsReader, tuple[str, ...], Shapes, Part], torch.Tensor]] = {
    Kind.REPLICATED: _read_replicated,
    Kind.ROW: _read_row,
    Kind.QKV: _read_qkv,
    Kind.GATE_UP: _read_gate_up,
    Kind.VOCAB: _read_vocab,
}
# The inverse of READ for a whole (TP = 1) Megatron tensor: its Hugging Face parts, in the order of `Mapping.hf`.
WRITE: dict[Kind, Callable[[torch.Tensor, Shapes], tuple[torch.Tensor, ...]]] = {
    Kind.REPLICATED: lambda tensor, s: (tensor,),
    Kind.ROW: lambda tensor, s: (tensor,),
    Kind.QKV: _split_qkv,
    Kind.GATE_UP: lambda tensor, s: tuple(tensor.chunk(2)),
    Kind.VOCAB: lambda tensor, s: (tensor[: s.vocab],),
}


def hf_to_megatron(
    reader: SafetensorsReader,
    names: Iterable[str],
    shapes: Shapes,
    part: TensorParallelPart = TensorParallelPart(),
    expert_part: TensorParallelPart | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, `part`'s share of the tensor) for each full-model Megatron parameter name, one tensor at a time: only
    what is asked for is read, and of a tensor-parallel weight only `part`'s rows or columns (of an expert's weight,
    `expert_part`'s: the expert-tensor-parallel rank, by default the same as `part`)."""
    for name in names:
        mapping, indices = mapping_of(name)
        share = (expert_part or part) if mapping.expert else part
        yield name, READ[mapping.kind](reader, mapping.hf_names(indices), shapes, share)


def to_hf(name: str, tensor: torch.Tensor, shapes: Shapes) -> list[tuple[str, torch.Tensor]]:
    """The Hugging Face tensors of one whole (TP = 1) Megatron tensor, named by the table: `WRITE` of its kind,
    vocabulary padding dropped. Views where the kind allows (no copy); works on meta tensors, whose shapes then say
    what would be written."""
    mapping, indices = mapping_of(name)
    return list(zip(mapping.hf_names(indices), WRITE[mapping.kind](tensor, shapes), strict=True))


def hf_dtype(hf_dir: str | Path) -> torch.dtype | None:
    """The dtype a Hugging Face config.json declares for its weights (`dtype`, or `torch_dtype` before transformers
    5); None when it declares none."""
    source = Path(hf_dir) / "config.json"
    config = json.loads(source.read_text())
    declared = config.get("dtype") or config.get("torch_dtype")
    if declared is None:
        return None
    if declared not in _HF_DTYPES:
        raise ConfigError([f"dtype {declared!r} is not one of {tuple(_HF_DTYPES)}; set the checkpoint's dtype there"],
                          str(source))  # fmt: skip
    return _HF_DTYPES[declared]


_HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
