"""A LoRA checkpoint's actor for Hugging Face: a `peft` adapter (`adapter_config.json` + `adapter_model.safetensors`)
that `PeftModel.from_pretrained` loads onto the Hugging Face base, or (`actor.lora.merge`) the merged weights
W + (α / r) · B A, written as `mcore_to_hf` writes any checkpoint.

Megatron fuses what Hugging Face keeps apart (linear_qkv = q, k, v; linear_fc1 = gate, up), and one adapter sits on
the fused layer: ΔW = B A with A `[r, in]` shared and B `[out, r]` the fused rows. In peft each part gets its own
adapter, so each part's is A (the same) and its rows of B — split by the conversion table exactly as the base
weight's rows are (`hf_conversion.to_hf`) — which gives each part the same ΔW rows, at the same rank and α.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.checkpoint.weights import CheckpointWeights
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import LoraSettings
from megatron_ppo.models.hf_conversion import Shapes, mapping_of, to_hf
from megatron_ppo.models.lora import is_adapter

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # how peft names a causal LM's modules in an adapter file


def base_name(adapter_name: str) -> tuple[str, str]:
    """(the base weight an adapter tensor sits on, "lora_A" or "lora_B"):
    `….linear_qkv.lora_B.weight` → (`….linear_qkv.weight`, "lora_B")."""
    layer, matrix, _ = adapter_name.rsplit(".", 2)
    return f"{layer}.weight", matrix


def adapter_settings(source: CheckpointWeights) -> LoraSettings | None:
    """The checkpoint's actor adapters' settings (rank, alpha, target layers, merge), from the run's config saved with
    it; None when the actor holds no adapters."""
    if not any(is_adapter(weight.name) for weight in source.weights()):
        return None
    checkpoint = source.path
    identity = RunIdentity.read(checkpoint)
    if identity is None or "actor.lora.alpha" not in identity.config:
        raise ConfigError([f"{checkpoint} holds LoRA adapters but no run.json saying their alpha; export a checkpoint "
                           "a training run saved"])  # fmt: skip
    config = identity.config
    return LoraSettings(rank=int(config["actor.lora.rank"]), alpha=float(config["actor.lora.alpha"]),
                        target_modules=list(config["actor.lora.target_modules"]),
                        merge=bool(config["actor.lora.merge"]))  # fmt: skip


def adapter_base(hf_dir: str | Path) -> Path | None:
    """The Hugging Face model a peft adapter export at `hf_dir` sits on (its `base_model_name_or_path`); None when
    `hf_dir` is not an adapter."""
    config = Path(hf_dir) / ADAPTER_CONFIG
    return Path(json.loads(config.read_text())["base_model_name_or_path"]) if config.is_file() else None


def merge_adapters(tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """One group's whole (TP = 1) tensors with each adapter folded into its base weight — W + scaling · B A,
    computed in fp32 and cast back to W's dtype — and the adapter tensors dropped."""
    merged = {name: tensor for name, tensor in tensors.items() if not is_adapter(name)}
    for name in tensors:
        base, matrix = base_name(name) if is_adapter(name) else (None, None)
        if matrix == "lora_A":
            a, b = tensors[name].float(), tensors[name.replace(".lora_A.", ".lora_B.")].float()
            merged[base] = (merged[base].float() + scaling * (b @ a)).to(merged[base].dtype)
    return merged


def peft_tensors(name: str, tensor: torch.Tensor, shapes: Shapes) -> list[tuple[str, torch.Tensor]]:
    """The peft adapter tensors of one whole (TP = 1) Megatron adapter tensor: A repeated for each fused part,
    B split into the parts' rows (each a copy of its own: safetensors writes no tensors that share memory)."""
    base, matrix = base_name(name)
    mapping, indices = mapping_of(base)
    parts = [(hf, tensor) for hf in mapping.hf_names(indices)] if matrix == "lora_A" else to_hf(base, tensor, shapes)
    return [(f"{PEFT_PREFIX}{hf.removesuffix('.weight')}.{matrix}.weight", part.clone()) for hf, part in parts]


def base_model_path(hf_config_dir: str | Path) -> str:
    """What the adapter names as its base (`base_model_name_or_path`, where peft loads the base from): the Hugging
    Face model's folder as an absolute path (a relative one would name another folder wherever the adapter is
    loaded from), or the argument as written where no such folder exists here (a Hub name)."""
    path = Path(hf_config_dir)
    return str(path.resolve()) if path.exists() else str(hf_config_dir)


def write_peft_adapter(source: CheckpointWeights, hf_config_dir: str | Path, out_dir: str | Path, rank: int,
                       alpha: float, shapes: Shapes) -> int:  # fmt: skip
    """Write the checkpoint's actor adapters (`source`) as a peft LoRA adapter for the Hugging Face model at
    `hf_config_dir`, reading a layer's adapters at a time; returns the bytes of tensors written. Dropout is a
    training setting: the adapter is written for inference (`inference_mode`, no dropout)."""
    tensors: dict[str, torch.Tensor] = {}
    for group in source.groups:
        adapters = [weight for weight in group if is_adapter(weight.name)]
        for name, tensor in source.read(adapters).items() if adapters else ():
            tensors.update(peft_tensors(name, tensor, shapes))
    modules = sorted({name.removeprefix(PEFT_PREFIX).split(".")[-3] for name in tensors})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_path(hf_config_dir),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": modules, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "init_lora_weights": True,
    }  # fmt: skip
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return sum(t.numel() * t.element_size() for t in tensors.values())
