"""Actor, critic and frozen reference: Megatron-Core `GPTModel` chunks for this process's pipeline stage."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

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
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import ROLES, LoraSettings, MegatronConfig, ModelConfig
from megatron_ppo.models.attention import with_sdpa_attention
from megatron_ppo.models.kernels import (
    transformer_engine_importable,
    transformer_engine_usable,
    uses_transformer_engine,
)
from megatron_ppo.models.lora import adapters_disabled, freeze_base, with_lora
from megatron_ppo.models.norms import LocalNorm, with_local_norms
from megatron_ppo.models.packing import pack_multiple
from megatron_ppo.models.router_replay import RouterReplayBinding, replay_bypasses
from megatron_ppo.models.transformer_config import build_transformer_config, padded_vocab_size
from megatron_ppo.models.value_head import ValueHead
from megatron_ppo.models.widths import PaddingTally, width_bucket
from megatron_ppo.parallel.device import current_device, on_cuda
from megatron_ppo.parallel.megatron_compat import rotary_per_token

logger = logging.getLogger(__name__)

# Besides the three PPO roles: the reward model `megatron-ppo score` runs, a critic's trunk and value head held frozen
REWARD_MODEL = "reward_model"
FROZEN_ROLES = ("ref", REWARD_MODEL)  # no gradients, no optimizer, not wrapped in DDP, eval mode
VALUE_HEAD_ROLES = ("critic", REWARD_MODEL)  # a `ValueHead` instead of the vocabulary output layer


@dataclass
class RoleModel:
    """One role's model on this rank: its pipeline chunks (several with VPP) and what built them."""

    role: str
    chunks: list[torch.nn.Module]
    config: TransformerConfig
    vocab_size: int  # the tokenizer's; logits beyond it are padding
    padded_vocab_size: int
    logprob_chunk_tokens: int | None = None  # model.logprob_chunk_tokens, for vocab_parallel_log_probs
    width_multiple: int = 1  # micro-batch widths are multiples of this (models.widths.width_bucket)
    padding: PaddingTally = field(default_factory=PaddingTally)  # tokens computed vs real, for perf/ metrics
    router_replay: RouterReplayBinding | None = None  # this model's routers, when routing replay is on
    pack_sequences: bool = False  # model.pack_sequences: micro-batches enter as [1, T] packs (models.packing)
    pass_notes: set[str] = field(default_factory=set)  # the kinds of pass logged so far (models.schedule)
    lora: LoraSettings | None = None  # the adapters on this model's linear layers (models.lora), None: none
    adapters_off: bool = False  # the actor's chunks run as its base model: the reference of a LoRA actor
    # The DDP chunks' gradient-accumulator nodes (each carries the hook that puts a parameter's gradient in its
    # bucket), held here instead of by the chunks: a node's hook is a closure over its chunk, so a chunk holding its
    # nodes is a cycle through C++ autograd nodes, freed only by the collector. A parameter holds its node weakly.
    grad_accumulators: list[Any] = field(default_factory=list, repr=False)

    @property
    def pack_multiple(self) -> int | None:
        """The multiple each sequence of a pack is padded to (`models.packing.pack_multiple`), None unpacked."""
        if not self.pack_sequences:
            return None
        sp_tp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        return pack_multiple(self.config.context_parallel_size, sp_tp)

    @property
    def is_trained(self) -> bool:
        return self.role not in FROZEN_ROLES

    @contextmanager
    def as_built(self) -> Iterator[None]:
        """While inside, forward passes compute this role's model: with `adapters_off` (the LoRA actor's base as its
        reference) the chunks' adapters are skipped."""
        with adapters_disabled(self.chunks) if self.adapters_off else nullcontext():
            yield


def base_reference(actor: RoleModel) -> RoleModel:
    """The reference of a LoRA actor: the actor's own chunks run with their adapters off (`RoleModel.as_built`) — the
    frozen base the adapters sit on, which the reference equals (it starts from the actor's weights), with no
    weights of its own."""
    return RoleModel(
        "ref", actor.chunks, actor.config, actor.vocab_size, actor.padded_vocab_size, actor.logprob_chunk_tokens,
        actor.width_multiple, pack_sequences=actor.pack_sequences, lora=actor.lora, adapters_off=True,
    )  # fmt: skip


@contextmanager
def eval_mode(*models: RoleModel | None) -> Iterator[None]:
    """The models' chunks in eval mode (no dropout) for forward passes that train nothing (experience, evaluation,
    generation); afterwards, also after an error, back in train mode where the role is trained (the frozen
    reference stays in eval). `None` entries (roles not built) are skipped."""
    built = [model for model in models if model is not None]
    # a chunk two models share (a LoRA actor and its base reference) goes back to train mode if either is trained
    trained = {id(chunk) for model in built if model.is_trained for chunk in model.chunks}
    for model in built:
        for chunk in model.chunks:
            chunk.eval()
    try:
        yield
    finally:
        for model in built:
            for chunk in model.chunks:
                chunk.train(id(chunk) in trained)


def select_layer_spec(model: ModelConfig, lora: LoraSettings | None = None) -> tuple[ModuleSpec, bool]:
    """Transformer Engine's fused layers on CUDA when installed (or demanded), Megatron's local spec otherwise; with
    `model.num_experts`, each layer's MLP is a MoE layer (TE's grouped-GEMM experts, or the local SequentialMLP).
    The local spec's norms are `LocalNorm` (sequence-parallel capable). With `lora` (enabled), the local spec (under
    `auto` also where TE is usable: the adapters sit on Megatron's own linear layers), its targets carrying adapters.

    Returns (spec, uses_te). Demanding TE where it cannot run fails with the fix in the message."""
    if model.transformer_impl == "transformer_engine" and not transformer_engine_usable():
        raise RuntimeError(
            "model.transformer_impl=transformer_engine, but Transformer Engine is not usable here "
            f"(CUDA available: {torch.cuda.is_available()}, transformer_engine installed: "
            f"{transformer_engine_importable()}); install the 'gpu' extra on a CUDA "
            "machine or set model.transformer_impl=local"
        )
    use_te = uses_transformer_engine(model, lora)
    num_experts = model.num_experts or None  # MoE layers: the router, the token dispatcher and the experts
    spec = (
        get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=model.qk_layernorm
        )
        if use_te
        else with_local_norms(
            with_sdpa_attention(
                get_gpt_layer_local_spec(
                    num_experts=num_experts, normalization=model.normalization, qk_layernorm=model.qk_layernorm
                )
            )
        )
    )
    if lora and lora.enabled:
        spec = with_lora(spec, lora)
    logger.info(
        "layer spec: %s%s%s",
        "Transformer Engine" if use_te else "Megatron local, attention through SDPA",
        f"; {model.num_experts} experts per layer, top-{model.num_experts_per_tok}" if num_experts else "",
        f"; LoRA rank {lora.rank} on {', '.join(lora.target_modules)}" if lora and lora.enabled else "",
    )
    return spec, use_te


def build_role_model(
    role: str,
    model: ModelConfig,
    layout: MegatronConfig,
    routing_replay: bool = False,
    lora: LoraSettings | None = None,
) -> RoleModel:
    """This rank's chunks of `role`'s GPT.

    actor: the policy, wrapped in Megatron's DDP (grad buffers, data-parallel reduction).
    critic: the same trunk with a `ValueHead` instead of the vocabulary output layer (untied), in DDP.
    ref: frozen — no gradients, no optimizer state, eval mode, not wrapped.
    reward_model: the critic's shape (trunk and `ValueHead`), frozen as the reference is (`megatron-ppo score`).
    `routing_replay` (the actor under `actor.router_replay.mode` R2/R3): Megatron's router replay on this model's
    routers, bound to it (`RoleModel.router_replay`); a router path that would bypass it is refused first.
    `lora` (enabled; a trained role): adapters on its linear layers (`models.lora`), everything else frozen but the
    critic's value head, so DDP and the optimizer hold the adapters (and the head) alone.
    Parallel state must already hold `layout` (see `megatron_ppo.parallel.init_distributed`).
    """
    lora = lora if lora is not None and lora.enabled else None
    if lora and role in FROZEN_ROLES:
        raise ValueError(f"the {role} model is frozen: it takes no adapters")
    if role not in (*ROLES, REWARD_MODEL):
        raise ValueError(f"unknown role {role!r}; expected one of {(*ROLES, REWARD_MODEL)}")
    spec, uses_te = select_layer_spec(model, lora)
    config = build_transformer_config(model, layout, with_aux_loss=role == "actor", routing_replay=routing_replay)
    bypasses = replay_bypasses(config) if routing_replay else []
    if bypasses:
        raise ConfigError([f"actor.router_replay.mode: {line}" for line in bypasses])
    vocab = padded_vocab_size(model, layout.tensor_model_parallel_size)
    num_chunks = layout.virtual_pipeline_model_parallel_size or 1
    chunks: list[torch.nn.Module] = []
    for vp_stage in range(num_chunks):
        stage = vp_stage if layout.virtual_pipeline_model_parallel_size else None
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage)
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage)
        # local spec: the final norm too is a LocalNorm (Megatron's block default would be its torch norm)
        block = (
            spec
            if uses_te
            else TransformerBlockSubmodules(
                layer_specs=[spec] * get_num_layers_to_build(config, vp_stage=stage), layer_norm=LocalNorm
            )
        )
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=vocab,
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=role not in VALUE_HEAD_ROLES
            and not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            rotary_base=int(model.rotary_base),
            rope_scaling=model.rope_scaling_factor is not None,
            rope_scaling_factor=model.rope_scaling_factor or 1.0,  # read only with rope_scaling
            vp_stage=stage,
        )
        rotary_per_token(gpt)  # a pack's RoPE from its per-token positions, once per forward (no host read)
        if role in VALUE_HEAD_ROLES and post_process:
            gpt.output_layer = ValueHead(config)
        elif post_process:
            batch_major_logits(gpt.output_layer, sequence_parallel=config.sequence_parallel)
        # Megatron's torch norms and our value head are made on the host in fp32: all of it to the run's device and
        # dtype (as Megatron-LM's Float16Module does), so norms run their fused bf16 kernels
        gpt.to(device=current_device(), dtype=config.params_dtype)
        for module in gpt.modules():  # RoPE's inverse frequencies: a plain fp32 attribute that .to() does not move
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                module.inv_freq = module.inv_freq.to(current_device())
        chunks.append(gpt)
    if role in FROZEN_ROLES:
        for chunk in chunks:
            chunk.requires_grad_(False)
            chunk.eval()
    else:
        if lora:
            for chunk in chunks:
                freeze_base(chunk, trained=("output_layer.",) if role in VALUE_HEAD_ROLES else ())
        ddp_config = data_parallel_config(layout)
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=index > 0)
            for index, chunk in enumerate(chunks)
        ]
    accumulators = [node for chunk in chunks for node in _take_grad_accumulators(chunk)]
    bucket = width_bucket(layout.make_sequence_length_divisible_by, on_cuda())
    replay = RouterReplayBinding(chunks, config) if routing_replay else None
    return RoleModel(
        role, chunks, config, model.vocab_size, vocab, model.logprob_chunk_tokens, bucket,
        router_replay=replay, pack_sequences=model.pack_sequences, lora=lora, grad_accumulators=accumulators,
    )  # fmt: skip


def _take_grad_accumulators(chunk: torch.nn.Module) -> list[Any]:
    """The gradient-accumulator nodes Megatron's DDP keeps alive in `grad_accs` (0.16.1 to 0.19), taken from it (the
    `RoleModel.grad_accumulators` field says why); none for a frozen chunk."""
    nodes = getattr(chunk, "grad_accs", [])
    if nodes:
        chunk.grad_accs = []
    return nodes


def data_parallel_config(layout: MegatronConfig) -> DistributedDataParallelConfig:
    """Megatron DDP settings, the same on both devices: gradients are reduced bucket by bucket while the backward
    pass still runs (`overlap_grad_reduce`; 40M-element buckets, Megatron's default) and, with the distributed
    optimizer, the updated parameters are all-gathered bucket by bucket ahead of the next forward
    (`overlap_param_gather`; call `sync_parameters` before reading weights outside a forward). Over gloo the
    reductions are asynchronous too, so the CPU suite runs the path GPU runs take."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=True,
        overlap_param_gather=layout.use_distributed_optimizer,
        use_distributed_optimizer=layout.use_distributed_optimizer,
    )


def sync_parameters(model: RoleModel) -> None:
    """Finish any parameter all-gather still pending from the last distributed-optimizer step (overlapped with the
    next forward on CUDA), so the weights can be read directly — before saving a checkpoint or converting."""
    for chunk in model.chunks:
        if isinstance(chunk, DistributedDataParallel) and chunk.use_forward_hook:
            chunk.start_param_sync(force_sync=True)


def zero_grad_buffers(model: RoleModel) -> None:
    """Zero the DDP gradient buffers for a new accumulation, also after a backward that stopped half-way (an
    out-of-memory error): with `overlap_grad_reduce` the bucket groups may then hold an all-reduce or
    reduce-scatter still in flight (waited for here, as every rank that raised left it matched) and per-parameter
    ready counts of a partial backward, which Megatron's `reset()` would take as the first iteration's complete
    ("golden") counts or assert on; dropped, so the next backward counts afresh."""
    for chunk in model.chunks:
        if not isinstance(chunk, DistributedDataParallel):
            continue
        for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups:
            if group.grad_reduce_handle is not None:
                group.grad_reduce_handle.wait()
                group.grad_reduce_handle = None
            if len(group.per_param_grad_ready_counts) != len(group.params):
                group.per_param_grad_ready_counts = {}
        chunk.zero_grad_buffer()


def batch_major_logits(output_layer: torch.nn.Module, sequence_parallel: bool) -> None:
    """Make the vocabulary output layer return its logits `[b, s, v / TP]` as a tensor of their own, contiguous —
    the one `[tokens, v / TP]` buffer of the step, into which `models.logprobs` writes their gradient — and only for
    the micro-batch's real `[rows, width]` when the schedule padded it (`logits_cut`).

    Without sequence parallelism the layer's input is transposed first, `[s, b, h]` → `[b, s, h]` (a copy h / v of
    the logits' size), and cut there, so the logits are computed for the real tokens alone and returned as the
    `[s, b, v / TP]` view that GPTModel's `logits.transpose(0, 1).contiguous()` turns back into them, copying
    nothing, forward or backward. Cutting the logits instead (a view into the padded ones) would cost a copy in
    each direction and a padded gradient buffer: three buffers at peak. With sequence parallelism the layer
    all-gathers its input along the sequence dimension (dim 0), so the padded logits `[S, B, v / TP]` are cut
    after it; GPTModel's transpose then copies the cut into a tensor of its own (the copy sequence parallelism
    costs anyway), and only the backward of the cut allocates a padded buffer."""

    def transpose_input(layer, args, kwargs):
        hidden = args[0].transpose(0, 1)
        if layer.real_shape is not None and not sequence_parallel:
            rows, width = layer.real_shape
            hidden = hidden[:rows, :width]
        return (hidden.contiguous(), *args[1:]), kwargs

    def transpose_output(layer, _args, output):
        logits, bias = output
        if sequence_parallel:
            if layer.real_shape is not None:
                rows, width = layer.real_shape
                logits = logits[:width, :rows]
            return logits, bias
        return logits.transpose(0, 1), bias

    output_layer.real_shape = None  # (rows, width) of the micro-batch under way, set by `logits_cut`
    if not sequence_parallel:
        output_layer.register_forward_pre_hook(transpose_input, with_kwargs=True)
    output_layer.register_forward_hook(transpose_output)


@contextmanager
def logits_cut(chunk: torch.nn.Module, rows: int, width: int) -> Iterator[None]:
    """While a forward of `chunk` runs: its vocabulary output layer (last stage, `batch_major_logits`) computes the
    logits of the first `rows` rows and `width` tokens only (the rest is padding); other chunks are unchanged."""
    layer = getattr(unwrap(chunk), "output_layer", None) if unwrap(chunk).post_process else None
    if layer is None or not hasattr(layer, "real_shape"):
        yield
        return
    layer.real_shape = (rows, width)
    try:
        yield
    finally:
        layer.real_shape = None


def unwrap(chunk: torch.nn.Module) -> GPTModel:
    """The GPTModel inside a DDP wrapper (or the model itself)."""
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def copy_weights(source: RoleModel, target: RoleModel) -> None:
    """Load `source`'s weights into `target`, chunk by chunk (the same architecture and parallel layout)."""
    for source_chunk, target_chunk in zip(source.chunks, target.chunks, strict=True):
        unwrap(target_chunk).load_state_dict(unwrap(source_chunk).state_dict())
