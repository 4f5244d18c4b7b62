"""`convert`: Hugging Face ↔ megatron-ppo checkpoints, and a logit check between the two.

A converted checkpoint is a megatron-ppo checkpoint holding the weights as "actor" (usable as
`model.init_checkpoint` for actor, reference and critic trunk). It is written with Megatron's distributed
checkpointing, so any TP/PP/EP layout loads it. The conversion runs under a TP×PP(×EP) layout (`torchrun` with that
many processes, or the trainer's own layout on first use): each process builds and fills only its shard, reading
only its pipeline stage's tensors and, of a mixture of experts, its own experts, so a 70B model (or a 235B MoE)
converts on the GPUs that will train it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_ppo import checkpoint
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import ClusterConfig, MegatronConfig, ModelConfig, PPOConfig
from megatron_ppo.config.validate import validate
from megatron_ppo.models import RoleModel, build_role_model, run_micro_batches, unwrap
from megatron_ppo.models.hf_conversion import (
    SafetensorsReader,
    Shapes,
    TensorParallelPart,
    hf_to_megatron,
    megatron_to_hf,
    model_config_from_hf,
    save_hf,
)
from megatron_ppo.parallel.device import on_cuda
from megatron_ppo.parallel.ranks import expert_parallel, expert_tensor_parallel, is_first_of_last_stage, tensor_parallel

SINGLE = MegatronConfig()


def conversion_layout(model: ModelConfig, tp: int, pp: int, ep: int = 1) -> MegatronConfig:
    """The layout `convert` runs at: TP×PP×EP, with sequence parallelism where Megatron requires it (MoE layers at
    TP > 1, on CUDA; the CPU path bends that requirement for forward passes, `parallel/cpu_compat.py`)."""
    return MegatronConfig(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        sequence_parallel=bool(model.num_experts) and tp > 1 and on_cuda(),
    )


def layout_problems(model: ModelConfig, layout: MegatronConfig) -> list[str]:
    """Why `model` cannot be split by `layout` on this machine's device (the config validation's layout and expert
    rules), if it cannot."""
    world = layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size * layout.expert_model_parallel_size
    config = PPOConfig(model=model, cluster=ClusterConfig(gpus_per_node=world, device="cuda" if on_cuda() else "cpu"))
    for role in ("actor", "ref", "critic"):
        getattr(config, role).megatron = layout
    return [p for p in validate(config) if ".megatron" in p]


def converted_init_checkpoint(
    hf_dir: str | Path, cache_dir: str | Path, model: ModelConfig, layout: MegatronConfig
) -> Path:
    """The cached conversion of `hf_dir` under `cache_dir`, converting on first use under the training layout
    (every rank takes part, each reading and holding only its own shard). `model` is the recipe's; it must
    describe the same network as the checkpoint's `config.json`."""
    found = checkpoint.find_resumable(cache_dir)
    if found is not None:
        return found
    if problems := architecture_mismatches(model, hf_dir):
        raise ConfigError(problems, source=str(Path(hf_dir) / "config.json"))
    return hf_to_mcore(hf_dir, cache_dir, model=model, layout=layout)


def architecture_mismatches(model: ModelConfig, hf_dir: str | Path) -> list[str]:
    """Each `model.*` key whose value differs from what the Hugging Face config.json says."""
    hf = model_config_from_hf(hf_dir)
    return [f"model.{key}={getattr(model, key)!r}, but {hf_dir}/config.json says {value!r}"
            for key, value in hf.items() if key != "name" and getattr(model, key) != value]  # fmt: skip


def hf_model_config(hf_dir: str | Path, params_dtype: str = "fp32") -> ModelConfig:
    return ModelConfig(**model_config_from_hf(hf_dir), params_dtype=params_dtype, make_vocab_size_divisible_by=128)


def hf_to_mcore(
    hf_dir: str | Path,
    out_dir: str | Path,
    params_dtype: str = "fp32",
    layout: MegatronConfig = SINGLE,
    model: ModelConfig | None = None,
) -> Path:
    """Convert under `layout`, which the process groups must hold. Each rank builds only its own TP/PP shard and
    reads from the safetensors only its part of its pipeline stage's tensors, one at a time, so no process holds
    the whole model, nor even a whole tensor-parallel weight; Megatron's distributed checkpointing then
    writes every shard once, and the result loads at any layout."""
    model = model or hf_model_config(hf_dir, params_dtype)
    shard = build_role_model("ref", model, layout)
    fill_from_hf(shard, hf_dir, model, layout)
    meta = {"step": 0, "hf_model": json.dumps(dataclasses.asdict(model))}
    return checkpoint.save_checkpoint(out_dir, 0, {"actor": shard}, {}, meta)


def fill_from_hf(
    shard: RoleModel, hf_dir: str | Path, model: ModelConfig, layout: MegatronConfig, skip: tuple[str, ...] = ()
) -> int:
    """Copy this rank's part of every weight from the safetensors into `shard`, except those whose full-model name
    starts with one of `skip` (the critic's value head); the bytes read (this pipeline stage's tensors, of
    tensor-parallel weights this TP rank's part only, and of the experts this EP rank's own, split by its expert-TP
    rank)."""
    targets = {name: t for name, t in _local_targets(shard, model).items() if not name.startswith(skip)}
    reader = SafetensorsReader(hf_dir)
    shapes = Shapes.of(model, layout.tensor_model_parallel_size)
    part = TensorParallelPart(*tensor_parallel())
    expert_part = TensorParallelPart(*expert_tensor_parallel())
    for name, tensor in hf_to_megatron(reader, targets, shapes, part, expert_part):
        for local_name, param in targets[name]:
            if tensor.shape != param.shape:
                raise RuntimeError(f"{local_name}: converted {tuple(tensor.shape)} ≠ the model's {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
    return reader.bytes_read


# A local expert number: SequentialMLP's `local_experts.{i}.`, TEGroupedMLP's `linear_fc1.weight{i}`.
_LOCAL_EXPERT = re.compile(r"(\.mlp\.experts\.(?:local_experts\.|linear_fc[12]\.weight))(\d+)(\.|$)")


def _local_targets(shard: RoleModel, model: ModelConfig) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Full-model (TP=1, PP=1, EP=1) weight name → this rank's parameters holding a part of it. Pipeline stages
    number their layers from 0; `layer_number` is the global one. Expert-parallel rank r numbers its E/EP experts
    from 0; they are experts r·E/EP + i of the model. A last stage with tied embeddings holds its own copy of the
    embedding as `output_layer.weight`."""
    first_expert = expert_parallel().rank * model.num_experts // expert_parallel().size
    targets: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for chunk in shard.chunks:
        gpt = unwrap(chunk)
        for name, tensor in gpt.state_dict(keep_vars=True).items():
            if name.endswith("_extra_state"):
                continue
            source = name
            if match := re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name):
                source = f"decoder.layers.{gpt.decoder.layers[int(match[1])].layer_number - 1}.{match[2]}"
                source = _LOCAL_EXPERT.sub(lambda m: f"{m[1]}{first_expert + int(m[2])}{m[3]}", source)
            elif name == "output_layer.weight" and not model.untie_embeddings_and_output_weights:
                source = "embedding.word_embeddings.weight"
            targets.setdefault(source, []).append((name, tensor))
    return targets


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
        full = gather_from_tensor_model_parallel_region(logits)[..., : model.vocab_size]
        return logits.new_zeros(()), {"logits": full}

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
    if ours is None or not is_first_of_last_stage():
        return None
    return float((ours.cpu() - hf_logits(hf_dir, input_ids)).abs().max())  # HF's model runs on the host
