"""`convert`: Hugging Face ↔ megatron-ppo checkpoints, and a logit check between the two.

A converted checkpoint is a megatron-ppo checkpoint holding the weights as "actor" (usable as
`model.init_checkpoint` for actor, reference and critic trunk). It is written with Megatron's distributed
checkpointing, so any TP/PP layout loads it: `--tp/--pp` only check that the model can be split that way.
The conversion builds the full model in one process (fine up to a few billion parameters on CPU).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_ppo.config.schema import ClusterConfig, MegatronConfig, ModelConfig, PPOConfig
from megatron_ppo.config.validate import validate
from megatron_ppo.models import build_role_model, run_micro_batches, unwrap
from megatron_ppo.models.hf_conversion import (
    SafetensorsReader,
    hf_to_megatron,
    megatron_to_hf,
    model_config_from_hf,
    save_hf,
)
from megatron_ppo.models.transformer_config import padded_vocab_size
from megatron_ppo.parallel import initialize_model_parallel
from megatron_ppo.train import checkpoint

SINGLE = MegatronConfig()


def layout_problems(model: ModelConfig, tp: int, pp: int) -> list[str]:
    """Why `model` cannot be split by TP×PP (the config validation's layout rules), if it cannot."""
    layout = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    config = PPOConfig(model=model, cluster=ClusterConfig(gpus_per_node=tp * pp))
    for role in ("actor", "ref", "critic"):
        getattr(config, role).megatron = layout
    return [p for p in validate(config) if ".megatron" in p]


def converted_init_checkpoint(hf_dir: str | Path, cache_dir: str | Path, params_dtype: str) -> Path:
    """The cached conversion of `hf_dir` under `cache_dir`, converting on first use. Every rank takes part (the
    process groups are switched to TP=1, PP=1 for it; the caller restores its own layout afterwards)."""
    found = checkpoint.find_resumable(cache_dir)
    if found is not None:
        return found
    initialize_model_parallel(SINGLE)
    return hf_to_mcore(hf_dir, cache_dir, params_dtype)


def hf_model_config(hf_dir: str | Path, params_dtype: str = "fp32") -> ModelConfig:
    return ModelConfig(**model_config_from_hf(hf_dir), params_dtype=params_dtype, make_vocab_size_divisible_by=128)


def hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, params_dtype: str = "fp32") -> Path:
    """Convert; the process groups must hold the single-process layout (TP=1, PP=1)."""
    model = hf_model_config(hf_dir, params_dtype)
    frozen = build_role_model("ref", model, SINGLE)
    gpt = unwrap(frozen.chunks[0])
    expected = {k for k in gpt.state_dict() if not k.endswith("_extra_state")}
    state = {name: tensor.to(gpt.config.params_dtype) for name, tensor in
             hf_to_megatron(SafetensorsReader(hf_dir), model, padded_vocab_size(model, 1))}  # fmt: skip
    if set(state) != expected:
        raise RuntimeError(
            f"conversion mismatch: missing {sorted(expected - set(state))}, extra {sorted(set(state) - expected)}"
        )
    gpt.load_state_dict(state, strict=False)
    meta = {"step": 0, "hf_model": json.dumps(dataclasses.asdict(model))}
    return checkpoint.save_checkpoint(out_dir, 0, {"actor": frozen}, {}, meta)


def mcore_to_hf(megatron_dir: str | Path, hf_config_dir: str | Path, out_dir: str | Path) -> Path:
    """Write a checkpoint's actor as Hugging Face safetensors (single-process layout)."""
    model = hf_model_config(hf_config_dir)
    actor = build_role_model("ref", model, SINGLE)
    checkpoint.load_weights(actor, megatron_dir, "actor")
    state = {k: v for k, v in unwrap(actor.chunks[0]).state_dict().items() if not k.endswith("_extra_state")}
    save_hf(megatron_to_hf(state, model), out_dir, hf_config_dir)
    return Path(out_dir)


def megatron_logits(megatron_dir: str | Path, model: ModelConfig, layout: MegatronConfig, input_ids: torch.Tensor):
    """Full-vocabulary logits `[b, s, V]` of the checkpoint's actor under `layout` (on the last pipeline stage,
    `None` elsewhere)."""
    actor = build_role_model("ref", model, layout)
    checkpoint.load_weights(actor, megatron_dir, "actor")

    def gather(batch, logits):
        return torch.zeros(()), {"logits": gather_from_tensor_model_parallel_region(logits)[..., : model.vocab_size]}

    outputs = run_micro_batches(actor, [{"input_ids": input_ids}], gather, forward_only=True)
    return outputs[0]["logits"].float() if outputs else None


def hf_logits(hf_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids).logits.float()


def verify(hf_dir: str | Path, megatron_dir: str | Path, layout: MegatronConfig, seed: int = 0) -> float | None:
    """Largest |logit difference| between the HF model and the converted checkpoint on a fixed prompt batch, on one
    reporting rank (last pipeline stage, first TP and DP rank); `None` on the others."""
    model = hf_model_config(hf_dir)
    input_ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    ours = megatron_logits(megatron_dir, model, layout, input_ids)
    reporting = (
        parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        and parallel_state.get_tensor_model_parallel_rank() == 0
        and parallel_state.get_data_parallel_rank() == 0
    )
    if ours is None or not reporting:
        return None
    return float((ours - hf_logits(hf_dir, input_ids)).abs().max())
