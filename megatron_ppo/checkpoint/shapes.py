"""Whether a checkpoint holds the model the config describes, read from its metadata before any model is built.

A checkpoint's `.metadata` (PyTorch distributed checkpointing) gives every tensor's global shape without reading
one (`checkpoint/weights.py` lists the keys). Megatron loads a role only into a model of the same global shapes, and
otherwise stops deep in the load with pages of `CheckpointingException: Global shape mismatch`. Compared here, per
role, with what the config builds:

    model.hidden_size          decoder.final_layernorm.weight            [h]
    model.num_layers           decoder.layers.self_attention.linear_qkv.weight   [L, (a + 2g)·d, h]
    heads, groups, head size   the same tensor's rows (a + 2g)·d: num_attention_heads a, num_query_groups g,
                               kv_channels d (default h / a)
    model.ffn_hidden_size      decoder.layers.mlp.linear_fc1.weight      [L, f or 2f (SwiGLU), h] (dense models)
    model.vocab_size           embedding.word_embeddings.weight          [V padded, h] (`layout.padded_vocab_size`)

Imports torch's checkpoint reader only (no Megatron): `megatron-ppo validate` runs it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from megatron_ppo.checkpoint.named import resumed_checkpoint
from megatron_ppo.config.layout import padded_vocab_size
from megatron_ppo.config.schema import ModelConfig, PPOConfig


def saved_shapes(checkpoint: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's global shape in the checkpoint directory `checkpoint` (a `step_N`), by key."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {key: tuple(md.size) for key, md in metadata.items() if isinstance(md, TensorStorageMetadata)}


DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def saved_dtype(checkpoint: str | Path, role: str) -> str:
    """The dtype `role`'s weights were saved in (its final norm's), as `model.params_dtype` spells it."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    md = metadata[f"{role}.decoder.final_layernorm.weight"]
    return DTYPES.get(md.properties.dtype, str(md.properties.dtype))


def shape_problems(shapes: dict[str, tuple[int, ...]], role: str, model: ModelConfig, tensor_parallel: int,
                   source: str) -> list[str]:  # fmt: skip
    """One line per `model.*` setting the `role`'s tensors in `shapes` disagree with (module docstring), naming both
    values; none when the role is not in the checkpoint (another check says so) or every shape agrees."""
    h, a = model.hidden_size, model.num_attention_heads
    g, d = model.num_query_groups or a, model.kv_channels or h // a
    ffn = model.ffn_hidden_size or 4 * h
    fc1 = (2 if model.activation == "swiglu" else 1) * ffn
    qkv = (a + 2 * g) * d
    checks = [
        ("decoder.final_layernorm.weight", 0, h, "model.hidden_size", str(h)),
        ("decoder.layers.self_attention.linear_qkv.weight", 0, model.num_layers, "model.num_layers",
         str(model.num_layers)),
        ("decoder.layers.self_attention.linear_qkv.weight", 1, qkv,
         "model.num_attention_heads / num_query_groups / kv_channels", f"({a} + 2·{g})·{d} = {qkv} QKV rows"),
        ("embedding.word_embeddings.weight", 0, padded_vocab_size(model, tensor_parallel), "model.vocab_size",
         f"{model.vocab_size} (padded to {padded_vocab_size(model, tensor_parallel)})"),
    ]  # fmt: skip
    if not model.num_experts:
        checks.append(("decoder.layers.mlp.linear_fc1.weight", 1, fc1, "model.ffn_hidden_size",
                       f"{ffn}" + (f" ({fc1} rows with SwiGLU)" if fc1 != ffn else "")))  # fmt: skip
    problems = []
    for name, axis, expected, key, ours in checks:
        shape = shapes.get(f"{role}.{name}")
        if shape is not None and len(shape) > axis and shape[axis] != expected:
            problems.append(f"{key}: the config builds {ours}, but {source} holds the {role}'s {name} of shape "
                            f"{list(shape)} (axis {axis}: {shape[axis]}); set the model to the checkpoint's shape "
                            "or use a checkpoint of this model")  # fmt: skip
    return problems


def checkpoint_problems(checkpoint: str | Path, config: PPOConfig) -> list[str]:
    """`shape_problems` of each trained role `checkpoint` holds, at that role's tensor-parallel size."""
    shapes = saved_shapes(checkpoint)
    problems = []
    for role in ("actor", "critic"):
        tp = getattr(config, role).megatron.tensor_model_parallel_size
        problems += shape_problems(shapes, role, config.model, tp, str(checkpoint))
    return problems


def resume_problems(config: PPOConfig) -> list[str]:
    """`checkpoint_problems` of the checkpoint the run would continue (`resumed_checkpoint`), with how to start a
    new run of this model instead; none when it holds this model or there is none. Asked before any work — the tiny
    task's SFT of the new shape included — and by `validate`."""
    checkpoint = resumed_checkpoint(config.trainer)
    problems = checkpoint_problems(checkpoint, config) if checkpoint is not None else []
    if problems:
        problems.append(f"{checkpoint} is the checkpoint trainer.resume_mode={config.trainer.resume_mode} continues; "
                        "for a new run of this model: another trainer.default_local_dir, or "
                        "trainer.resume_mode=disable trainer.overwrite=true")  # fmt: skip
    return problems
