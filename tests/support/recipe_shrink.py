"""A shipped recipe at smoke-test size: the overrides that keep every layout and feature flag it sets (sequence
parallel, PP with virtual stages, the distributed optimizer, recompute, offload, dynamic batch sizes, EP/expert TP)
and shrink only sizes, derived from the loaded recipe so that a new recipe is covered without a hand-made copy.

Sizes: every parallel size > 1 becomes 2 (virtual stages: 2); the world is the smallest that fills every role's
layout (TP·PP·CP and expert TP·EP·PP), with a data-parallel size of 2 where the recipe has one > 1 and the world
stays ≤ 4. The model keeps its architecture flags (norms, RoPE and its scaling, QKV bias, QK layernorm, GQA, tied or
untied embeddings, MoE routing) at hidden 64, 4 heads (2 KV groups under GQA), one layer per virtual stage (2 without
PP), 4 experts (top-k ≤ 2); FFN and head widths keep their ratio to the hidden size. Batches: 16 rows, mini-batches
of 8, one PPO epoch, micro-batches ≤ 2 rows, token budgets in the recipe's ratio to the longest row. Weights in
fp32, as `configs/clusters/cpu.yaml` has them (bf16 runs on CPU, but its resume drifts: see the smoke test). A setting
`config/gpu_only.py` lists is replaced by its CPU stand-in (`GpuOnly.cpu_stand_in`), and named in `swapped`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from megatron_ppo.config.gpu_only import GPU_ONLY
from megatron_ppo.config.schema import ROLES, MegatronConfig, PPOConfig

HIDDEN = 64
HEADS = 4
EXPERTS = 4
PROMPT, RESPONSE = 16, 16
BATCH, MINI_BATCH, MICRO_BATCH = 16, 8, 2
MAX_WORLD = 4
PARALLEL_SIZES = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
    "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
)  # fmt: skip
MICRO_BATCH_KEYS = {
    "actor": ("ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu"),
    "ref": ("log_prob_micro_batch_size_per_gpu",),
    "critic": ("ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu"),
}


@dataclass(frozen=True)
class Shrunk:
    """`recipe` at smoke-test size: `overrides` (the paths of a run's data, tokenizer and directories come on top),
    the `world` it runs on, the GPU-only settings `swapped` for their CPU stand-ins, and its `layout` (what two
    recipes must share to share a run)."""

    recipe: Path
    world: int
    overrides: tuple[str, ...]
    swapped: tuple[str, ...]
    layout: tuple

    @property
    def name(self) -> str:
        return self.recipe.stem


def _multiple(value: float, step: int = 8) -> int:
    return max(step, step * round(value / step))


def _shrunk_layout(layout: MegatronConfig) -> MegatronConfig:
    sizes = {name: min(getattr(layout, name), 2) for name in PARALLEL_SIZES if getattr(layout, name) is not None}
    shrunk = dataclasses.replace(layout, **sizes)
    if shrunk.pipeline_model_parallel_size == 1:
        shrunk = dataclasses.replace(shrunk, virtual_pipeline_model_parallel_size=None)
    return shrunk


def _grid(layout: MegatronConfig) -> tuple[int, int]:
    """(TP·PP·CP, expert TP·EP·PP): the world must be a multiple of both."""
    pp = layout.pipeline_model_parallel_size
    model = layout.tensor_model_parallel_size * pp * layout.context_parallel_size
    expert_tp = layout.expert_tensor_parallel_size or layout.tensor_model_parallel_size
    return model, expert_tp * layout.expert_model_parallel_size * pp


def _world(config: PPOConfig, layouts: dict[str, MegatronConfig]) -> int:
    world = math.lcm(*(size for layout in layouts.values() for size in _grid(layout)))
    recipe_world = config.cluster.nodes * config.cluster.gpus_per_node
    data_parallel = recipe_world // _grid(config.actor.megatron)[0]
    if data_parallel > 1 and world // _grid(layouts["actor"])[0] == 1 and 2 * world <= MAX_WORLD:
        world *= 2
    return world


def shrink(recipe: Path, config: PPOConfig) -> Shrunk:
    """`config` (loaded from `recipe`) at smoke-test size, as the module docstring says."""
    swapped = [entry for entry in GPU_ONLY if entry.present(config)]
    overrides = [override for entry in swapped for override in entry.cpu_stand_in]
    stand_in = {o.split("=", 1)[0]: o.split("=", 1)[1] for o in overrides}
    layouts = {role: _shrunk_layout(getattr(config, role).megatron) for role in ROLES}
    for role, layout in layouts.items():
        for name, value in dataclasses.asdict(layout).items():
            key = f"{role}.megatron.{name}"
            if key in stand_in:
                layouts[role] = layout = dataclasses.replace(layout, **{name: int(stand_in[key])})
            elif value != getattr(getattr(config, role).megatron, name):
                overrides.append(f"{key}={'null' if value is None else value}")
    chunks = max(layout.pipeline_model_parallel_size * (layout.virtual_pipeline_model_parallel_size or 1)
                 for layout in layouts.values())  # fmt: skip
    layers_per_chunk = 1 if chunks > 1 else 2
    for role, layout in layouts.items():
        if layout.recompute_num_layers is not None:
            layers = min(layout.recompute_num_layers, layers_per_chunk)
            overrides.append(f"{role}.megatron.recompute_num_layers={layers}")
    overrides += _model_overrides(config, chunks * layers_per_chunk)
    overrides += _batch_overrides(config)
    world = _world(config, layouts)
    overrides += ["cluster.device=cpu", "cluster.gpu_type=cpu", "cluster.nodes=1", f"cluster.gpus_per_node={world}",
                  "trainer.total_training_steps=2", "trainer.total_epochs=1"]  # fmt: skip
    flags = (
        config.model.num_experts > 0,
        config.actor.use_dynamic_bsz,
        config.critic.use_dynamic_bsz,
        config.model.pack_sequences,
        config.actor.lora.enabled,  # a LoRA recipe's run is not its full fine-tune's, nor the other way round
        config.critic.lora.enabled,
    )
    layout_key = (world, flags, *(tuple(dataclasses.asdict(layouts[role]).items()) for role in ROLES))
    return Shrunk(recipe, world, tuple(overrides), tuple(entry.setting for entry in swapped), layout_key)


def _model_overrides(config: PPOConfig, num_layers: int) -> list[str]:
    model = config.model
    head_dim = model.hidden_size // model.num_attention_heads
    width = HIDDEN / model.hidden_size
    out = [f"model.num_layers={num_layers}", f"model.hidden_size={HIDDEN}", f"model.num_attention_heads={HEADS}",
           f"model.max_position_embeddings={PROMPT + RESPONSE}", "model.hf_checkpoint=null",
           "model.init_checkpoint=null", "model.allow_random_init=true", "critic.model.hf_checkpoint=null",
           "critic.model.init_checkpoint=null", "model.params_dtype=fp32"]  # fmt: skip
    if model.num_query_groups is not None and model.num_query_groups < model.num_attention_heads:
        out.append("model.num_query_groups=2")
    elif model.num_query_groups is not None:
        out.append(f"model.num_query_groups={HEADS}")
    if model.kv_channels is not None:  # an explicit head width keeps its ratio to hidden / heads
        out.append(f"model.kv_channels={_multiple(model.kv_channels / head_dim * HIDDEN / HEADS)}")
    if model.ffn_hidden_size is not None:
        out.append(f"model.ffn_hidden_size={_multiple(model.ffn_hidden_size * width)}")
    if model.num_experts:
        out += [f"model.num_experts={EXPERTS}", f"model.num_experts_per_tok={min(model.num_experts_per_tok, 2)}",
                f"model.moe_intermediate_size={_multiple(model.moe_intermediate_size * width)}"]  # fmt: skip
    return out


def _batch_overrides(config: PPOConfig) -> list[str]:
    longest = config.data.max_length
    out = [f"data.max_prompt_length={PROMPT}", f"data.max_response_length={RESPONSE}",
           f"data.train_batch_size={BATCH}"]  # fmt: skip
    for role, keys in MICRO_BATCH_KEYS.items():
        section = getattr(config, role)
        out += [f"{role}.{key}={min(getattr(section, key), MICRO_BATCH)}" for key in keys]
        if role != "ref":
            budget = max(PROMPT + RESPONSE, round(section.ppo_max_token_len_per_gpu * (PROMPT + RESPONSE) / longest))
            out += [f"{role}.ppo_mini_batch_size={MINI_BATCH}", f"{role}.ppo_epochs=1",
                    f"{role}.ppo_max_token_len_per_gpu={budget}"]  # fmt: skip
    return out
