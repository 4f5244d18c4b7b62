"""Actor, critic and frozen reference: Megatron-Core `GPTModel` chunks for this process's pipeline stage."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models.transformer_config import build_transformer_config, padded_vocab_size
from megatron_ppo.models.value_head import ValueHead

logger = logging.getLogger(__name__)
ROLES = ("actor", "critic", "ref")


@dataclass
class RoleModel:
    """One role's model on this rank: its pipeline chunks (several with VPP) and what built them."""

    role: str
    chunks: list[torch.nn.Module]
    config: TransformerConfig
    vocab_size: int  # the tokenizer's; logits beyond it are padding
    padded_vocab_size: int

    @property
    def is_trained(self) -> bool:
        return self.role != "ref"


def transformer_engine_usable() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def select_layer_spec(model: ModelConfig) -> tuple[ModuleSpec, bool]:
    """Transformer Engine's fused layers on CUDA when installed (or demanded), Megatron's local spec otherwise.

    Returns (spec, uses_te). Demanding TE where it cannot run fails with the fix in the message."""
    if model.transformer_impl == "transformer_engine" and not transformer_engine_usable():
        raise RuntimeError(
            "model.transformer_impl=transformer_engine, but Transformer Engine is not usable here "
            f"(CUDA available: {torch.cuda.is_available()}, transformer_engine installed: "
            f"{importlib.util.find_spec('transformer_engine') is not None}); install the 'gpu' extra on a CUDA "
            "machine or set model.transformer_impl=local"
        )
    use_te = model.transformer_impl == "transformer_engine" or (
        model.transformer_impl == "auto" and transformer_engine_usable()
    )
    spec = (
        get_gpt_layer_with_transformer_engine_spec(qk_layernorm=model.qk_layernorm)
        if use_te
        else get_gpt_layer_local_spec(normalization=model.normalization, qk_layernorm=model.qk_layernorm)
    )
    logger.info("layer spec: %s", "Transformer Engine" if use_te else "Megatron local (pure PyTorch)")
    return spec, use_te


def build_role_model(role: str, model: ModelConfig, layout: MegatronConfig) -> RoleModel:
    """This rank's chunks of `role`'s GPT.

    actor: the policy, wrapped in Megatron's DDP (grad buffers, data-parallel reduction).
    critic: the same trunk with a `ValueHead` instead of the vocabulary output layer (untied), in DDP.
    ref: frozen — no gradients, no optimizer state, eval mode, not wrapped.
    Parallel state must already hold `layout` (see `megatron_ppo.parallel.init_distributed`).
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    spec, uses_te = select_layer_spec(model)
    config = build_transformer_config(model, layout, use_gpu_kernels=uses_te)
    vocab = padded_vocab_size(model, layout.tensor_model_parallel_size)
    num_chunks = layout.virtual_pipeline_model_parallel_size or 1
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(num_chunks):
        stage = vp_stage if layout.virtual_pipeline_model_parallel_size else None
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=role != "critic" and not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            rotary_base=int(model.rotary_base),
            rope_scaling=model.rope_scaling_factor is not None,
            rope_scaling_factor=model.rope_scaling_factor or 1.0,  # read only with rope_scaling
            vp_stage=stage,
        )
        if role == "critic" and post_process:
            gpt.output_layer = ValueHead(config)
        chunks.append(gpt)
    if role == "ref":
        for chunk in chunks:
            chunk.requires_grad_(False)
            chunk.eval()
    else:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,
            overlap_grad_reduce=False,
            use_distributed_optimizer=layout.use_distributed_optimizer,
        )
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
    return RoleModel(role, chunks, config, model.vocab_size, vocab)


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside a DDP wrapper (or the model itself)."""
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk
