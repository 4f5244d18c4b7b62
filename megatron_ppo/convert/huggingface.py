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
from dataclasses import dataclass
from pathlib import Path

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_ppo.checkpoint import directory, store
from megatron_ppo.checkpoint.shapes import saved_dtype
from megatron_ppo.checkpoint.weights import CheckpointWeights
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import ROLES, ClusterConfig, LoraSettings, MegatronConfig, ModelConfig, PPOConfig
from megatron_ppo.config.validate import validate
from megatron_ppo.convert import peft_adapter
from megatron_ppo.models import RoleModel, build_role_model, run_micro_batches, unwrap
from megatron_ppo.models.hf_conversion import (
    SafetensorsReader,
    Shapes,
    TensorParallelPart,
    hf_dtype,
    hf_to_megatron,
    model_config_from_hf,
    to_hf,
)
from megatron_ppo.models.hf_shards import DEFAULT_MAX_SHARD_BYTES, OutputExistsError, ShardedSafetensorsWriter
from megatron_ppo.models.lora import is_adapter
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
    cluster = ClusterConfig(gpus_per_node=world, device="cuda" if on_cuda() else "cpu")
    config = with_changes(PPOConfig(model=model, cluster=cluster), {f"{role}.megatron": layout for role in ROLES})
    return [p for p in validate(config) if ".megatron" in p]


def converted_init_checkpoint(
    hf_dir: str | Path, cache_dir: str | Path, model: ModelConfig, layout: MegatronConfig
) -> Path:
    """The cached conversion of `hf_dir` under `cache_dir`, converting on first use under the training layout
    (every rank takes part, each reading and holding only its own shard). `model` is the recipe's; it must
    describe the same network as the checkpoint's `config.json`."""
    found = directory.find_resumable(cache_dir)
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


def check_new_output(out_dir: str | Path) -> None:
    """`convert hf-to-mcore --out` writes a new checkpoint: into a directory that does not exist or is empty, never
    over a run's checkpoints (it would replace `step_0` and move `latest`) or anything else."""
    out = Path(out_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputExistsError(f"--out {out} is a file: give a new directory")
    held = sorted(entry.name for entry in out.iterdir())
    if not held:
        return
    steps = directory.step_directories(out)
    what = (f"a training run's checkpoints ({', '.join(p.name for _, p in steps[:4])}"
            f"{', …' if len(steps) > 4 else ''}; `latest` names {directory.named_by_latest(out).name})"
            if steps and directory.named_by_latest(out) else f"{len(held)} entries ({', '.join(held[:4])}"
            f"{', …' if len(held) > 4 else ''})")  # fmt: skip
    raise OutputExistsError(f"--out {out} holds {what}: the conversion writes only into a new or empty directory, "
                            "so nothing there is replaced; choose another --out")  # fmt: skip


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
    return store.save_checkpoint(out_dir, 0, {"actor": shard}, {}, meta)


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


@dataclass(frozen=True)
class Export:
    """What `mcore_to_hf` wrote: the directory, its safetensors files, the bytes of weights written (in the output
    dtype) and the most one group's read allocated (one layer, or the embedding / output layer)."""

    path: Path
    files: tuple[str, ...]
    total_bytes: int
    largest_group_bytes: int

    def describe(self) -> str:
        return (f"{self.path}: {len(self.files)} safetensors files, {self.total_bytes / 1e9:.3g} GB; held at most "
                f"{self.largest_group_bytes / 1e9:.3g} GB of weights at once (a layer, or the embedding)")  # fmt: skip


def mcore_to_hf(
    megatron_dir: str | Path,
    hf_config_dir: str | Path,
    out_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    merge_lora: bool = False,
) -> Export:
    """Write a checkpoint's actor as Hugging Face safetensors, one layer at a time: its tensors are read from the
    checkpoint's files (any TP/PP/EP layout saved them; no model is built, no process group needed), converted by the
    table (`to_hf`: vocabulary padding dropped) and written into their shard (`ShardedSafetensorsWriter`), so a
    process holds one layer's weights (or the embedding's) at a time, never the model. The output dtype is the one
    `hf_config_dir`'s config.json declares, else the checkpoint's; `megatron_dir` may be a checkpoint root (its
    newest complete checkpoint). A LoRA run's actor (`actor.lora.*` in its run.json) is written as a peft adapter
    for the model at `hf_config_dir`, or with `merge_lora` (`--merge-lora`) or the run's `actor.lora.merge` as
    merged weights (`peft_adapter`)."""
    model = hf_model_config(hf_config_dir)
    shapes, dtype = Shapes.of(model), hf_dtype(hf_config_dir)
    source = CheckpointWeights(directory.resolve(megatron_dir, prove=True), "actor")
    if problems := _export_mismatches(source, model):
        raise ConfigError(problems, source=str(Path(hf_config_dir) / "config.json"))
    lora = peft_adapter.adapter_settings(source)  # a LoRA run's actor: its adapters, or merged weights
    if lora is not None and not (lora.merge or merge_lora):
        check_new_output(out_dir)
        written = peft_adapter.write_peft_adapter(source, hf_config_dir, out_dir, lora.rank, lora.alpha, shapes)
        return Export(Path(out_dir), (peft_adapter.ADAPTER_WEIGHTS,), written, source.largest_group_bytes)
    planned = {hf: (part.shape, dtype or weight.dtype) for weight in source.weights() if not is_adapter(weight.name)
               for hf, part in to_hf(weight.name, torch.empty(weight.shape, device="meta"), shapes)}  # fmt: skip
    with ShardedSafetensorsWriter(out_dir, planned, hf_config_dir, max_shard_bytes) as writer:
        for group in source.groups:
            tensors = source.read(group, None if lora else dtype)
            if lora is not None:  # merged in the checkpoint's precision (fp32 at least), then cast
                merged = peft_adapter.merge_adapters(tensors, lora.alpha / lora.rank)
                tensors = {name: tensor.to(dtype or tensor.dtype) for name, tensor in merged.items()}
            for name, tensor in tensors.items():
                for hf, part in to_hf(name, tensor, shapes):
                    writer.write(hf, part)
    return Export(Path(out_dir), tuple(writer.files), writer.total_bytes, source.largest_group_bytes)


def _export_mismatches(source: CheckpointWeights, model: ModelConfig) -> list[str]:
    """Where the checkpoint's actor is not the model the Hugging Face config.json describes: its layer and expert
    counts, the output layer (untied only), the vocabulary and the shapes of the weights that size a layer."""
    s, hidden = Shapes.of(model), model.hidden_size
    expected = {
        "decoder.layers.0.self_attention.linear_qkv.weight": (s.q_rows + 2 * s.kv_rows, hidden),
        "decoder.layers.0.self_attention.linear_proj.weight": (hidden, s.q_rows),
        "decoder.layers.0.mlp.linear_fc1.weight": (2 * (model.ffn_hidden_size or 0), hidden),
        "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight": (2 * model.moe_intermediate_size, hidden),
        "decoder.final_layernorm.weight": (hidden,),
    }
    held = {weight.name: tuple(weight.shape) for weight in source.weights()}
    problems = [f"{name} is {held[name]}, the config's model has {shape}"
                for name, shape in expected.items() if held.get(name, shape) != shape]  # fmt: skip
    rows, columns = held.get("embedding.word_embeddings.weight", (model.vocab_size, hidden))
    if rows < model.vocab_size or columns != hidden:
        problems.append(f"the embedding is ({rows}, {columns}), the config's vocabulary ({model.vocab_size}, {hidden})")
    if source.num_layers != model.num_layers:
        problems.append(f"num_hidden_layers={model.num_layers}, but {source.path} holds {source.num_layers} layers")
    experts = sum(name.startswith("decoder.layers.0.mlp.experts.") and "fc1" in name for name in held)
    if experts != model.num_experts:
        problems.append(f"the config's model has {model.num_experts} experts a layer, {source.path} {experts}")
    if ("output_layer.weight" in held) != model.untie_embeddings_and_output_weights:
        problems.append(f"tie_word_embeddings={not model.untie_embeddings_and_output_weights}, but {source.path} "
                        f"{'holds' if 'output_layer.weight' in held else 'lacks'} an output layer")  # fmt: skip
    return [f"{p}: pass the --hf-config the checkpoint was trained from" for p in problems]


def megatron_logits(megatron_dir: str | Path, model: ModelConfig, layout: MegatronConfig, input_ids: torch.Tensor,
                    lora: LoraSettings | None = None):  # fmt: skip
    """Full-vocabulary logits `[b, s, V]` of the checkpoint's actor under `layout` (on the last pipeline stage,
    `None` elsewhere); with `lora` (a LoRA checkpoint's), its adapters on: W x + (α / r) · B A x, as it trained."""
    if lora is None:
        actor = build_role_model("ref", model, layout)
        store.load_weights(actor, megatron_dir, "actor")
    else:
        actor = build_role_model("actor", model, layout, lora=lora)
        store.load_weights(actor, megatron_dir, "actor", adapters=True)

    def gather(batch, logits):
        full = gather_from_tensor_model_parallel_region(logits)[..., : model.vocab_size]
        return logits.new_zeros(()), {"logits": full}

    outputs = run_micro_batches(actor, [{"input_ids": input_ids}], gather, forward_only=True)
    return outputs[0]["logits"].float() if outputs else None


def hf_logits(hf_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """The Hugging Face model's logits in fp32; a peft adapter export at `hf_dir` on the base it names (peft)."""
    import transformers

    base = peft_adapter.adapter_base(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(base or hf_dir, dtype=torch.float32)
    if base is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, hf_dir)
    with torch.no_grad():
        return model(input_ids).logits.float()


@dataclass(frozen=True)
class Verdict:
    """`verify`'s comparison: the largest |logit difference|, the largest |HF logit| (the scale a 16-bit checkpoint's
    rounding is relative to) and the dtype the checkpoint's weights were saved in."""

    difference: float
    largest_logit: float
    saved_dtype: str
    compared: str = ""  # what was compared, where more than the weights: the adapters on, a peft adapter

    def tolerance(self, given: float | None = None) -> tuple[float, str]:
        """`given`, or by the dtype compared: an fp32 checkpoint against the fp32 Hugging Face model holds the same
        values (1e-3: summation order only); a 16-bit one rounded every weight (2⁻⁸ relative for bf16, 2⁻¹¹ fp16),
        which the logits carry through every layer: 2⁻⁵ of the largest logit (at least 1) — an estimate, measured on
        the tiny test models at 4.2e-3 of logits near 1 (bf16)."""
        if given is not None:
            return given, "--tolerance"
        if self.saved_dtype == "fp32":
            return 1e-3, "fp32 against fp32"
        scale = max(1.0, self.largest_logit)
        return 2**-5 * scale, f"2⁻⁵ of the largest logit {scale:.3g}: a {self.saved_dtype} checkpoint"

    def line(self, given: float | None = None) -> tuple[bool, str]:
        tolerance, why = self.tolerance(given)
        ok = self.difference <= tolerance
        return ok, (f"convert verify {'passed' if ok else 'FAILED'}: largest logit difference {self.difference:.3e} "
                    f"{'≤' if ok else '>'} {tolerance:.3e} ({why}{'; ' if self.compared else ''}"
                    f"{self.compared})")  # fmt: skip


def verify(hf_dir: str | Path, megatron_dir: str | Path, layout: MegatronConfig, seed: int = 0) -> Verdict | None:
    """The HF model and the converted checkpoint on a fixed prompt batch, on one reporting rank (last pipeline
    stage, first TP and DP rank); `None` on the others. A LoRA checkpoint is compared with its adapters on, against
    a merged export (`mcore-to-hf --merge-lora`) or a peft adapter export at `hf_dir` (on the base it names)."""
    base = peft_adapter.adapter_base(hf_dir)
    model = hf_model_config(base or hf_dir)
    checkpoint = directory.resolve(megatron_dir)
    lora = peft_adapter.adapter_settings(CheckpointWeights(checkpoint, "actor"))
    input_ids = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(seed))
    ours = megatron_logits(checkpoint, model, layout, input_ids, lora)
    if ours is None or not is_first_of_last_stage():
        return None
    theirs = hf_logits(hf_dir, input_ids)  # HF's model runs on the host
    compared = [f"the checkpoint's LoRA adapters on (rank {lora.rank}, alpha {lora.alpha:g})"] if lora else []
    compared += [f"against the peft adapter on {base}"] if base else []
    return Verdict(float((ours.cpu() - theirs).abs().max()), float(theirs.abs().max()),
                   saved_dtype(checkpoint, "actor"), ", ".join(compared))  # fmt: skip
