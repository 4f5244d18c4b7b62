"""Plan a recipe on its cluster before any job: parameter counts, per-GPU memory per role and phase, pipeline
bubble, whether it fits, the nearest layout that does, and a FLOP-based step-time estimate.

Memory model (per GPU; see docs/planner.md for the sources):
    weights      2 bytes per parameter (bf16/fp16) or 4 (fp32), of the most loaded pipeline stage
                 (`stage_parameters`: its L/PP layers split by TP, the norms replicated, plus the first stage's
                 input embedding and the last stage's output layer and final norm, the vocabulary padded as Megatron
                 pads it: Megatron-LM's "most loaded shard", `theoretical_memory_usage.py`)
    gradients    4 (Megatron DDP reduces gradients in fp32)
    optimizer    12 (fp32 master weights + Adam m and v; 8 when the weights are fp32 already), divided by DP with
                 the distributed optimizer
    LoRA         (`<role>.lora.rank` > 0) gradients and optimizer states of the adapters alone (`lora_parameters`;
                 the critic's value head too), the base's weights kept; a LoRA actor's reference holds no weights
                 (it is the actor's base with the adapters off)
    activations  what each transformer layer saves for its backward, counted tensor by tensor
                 (`layer_activation_bytes`, measured with saved-tensor hooks on the real model), times the layers a
                 stage keeps (all of them; with full recompute each layer's input, plus one layer's set while it is
                 recomputed) and the micro-batches in flight on the first stage (1F1B: min(PP, micro-batches);
                 interleaved: Megatron-LM's penalty 1 + (PP − 1)/(PP·VPP)); plus fp32 log-probs of the output;
                 per micro-batch of `micro_batch_tokens` tokens: with `model.pack_sequences` one pack of the token
                 budget, else rows × padded width (`micro_batch_rows` full-length rows)
    reserved     3 GiB per GPU (CUDA context, NCCL buffers, allocator fragmentation)
    KV cache     of an evaluation's greedy answers (`models.generation`, data.val_files): keys and values of the
                 rank's layers, 2 · L/PP · B · (prompt + response) · groups/TP · head_dim weight-size values for a
                 batch of B rows per replica, next to the between-iterations state: B = GENERATION_BATCH_ROWS, or
                 fewer where the cache would take more than GENERATION_CACHE_SHARE of the memory left (reported
                 beside the phases; the runtime sizes it from the free memory the same way)
Roles share the GPUs. Each phase of an iteration (`phases.py`, the table host offload moves state by:
experience, critic update, actor update, between iterations) needs some kinds of each role's state on the GPU; a
role keeps those plus every kind whose offload switch (`param_offload`, `grad_offload`, `optimizer_offload`) is off,
and the rest waits in host memory (`resident_kinds`). The peak is the largest phase. Layout arithmetic is
`config/layout.py`'s, parameter and FLOP counts `flops.py`'s (the trainer's MFU counts with them too).

Mixture of experts (`model.num_experts` > 0): the routed experts' weights, gradients and optimizer states are split
by EP × expert-TP × PP (the optimizer further by the expert-data-parallel size world / (ETP·EP·PP)); everything
else by TP × PP as above. FLOPs count the active parameters (top-k experts per token). The expert MLP's activations
are k·(h + 3·f)·e / TP bytes per token and layer (each token's k copies of its input, the gate/up output and the
SwiGLU output, e bytes each, with balanced routing; not measured) in place of the dense MLP's FC1 output and FC2
input. The token all-to-all's time is
added to the step, not overlapped (`all_to_all_estimate`, its bandwidths an assumption).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from dataclasses import dataclass

from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.gpus import gpu_spec
from megatron_ppo.config.layout import data_parallel_size, expert_layout, padded_vocab_size, world_size
from megatron_ppo.config.schema import ROLES, ClusterConfig, LoraSettings, MegatronConfig, ModelConfig, PPOConfig
from megatron_ppo.config.validate import validate
from megatron_ppo.planner.flops import (
    active_parameter_count,
    expert_parameter_count,
    flop_parameter_count,
    iteration_flops,
    parameter_count,
)
from megatron_ppo.planner.phases import (
    GENERATION_BATCH_ROWS,
    GENERATION_CACHE_SHARE,
    PHASE_NEEDS,
    Phase,
    offload_switches,
    resident_kinds,
)

GIB = 1024**3
RESERVED_GIB = 3.0
MARGIN = 0.10  # keep 10 % of the GPU free


def gpu_memory_gib(cluster: ClusterConfig) -> float:
    """GiB of one GPU that the plan may fill (before the margin): `cluster.gpu_memory_gib` when set, else the GPU
    type's memory (`config/gpus.py`)."""
    return gpu_spec(cluster.gpu_type).memory_gib if cluster.gpu_memory_gib is None else cluster.gpu_memory_gib


@dataclass
class RolePlan:
    role: str
    params: int
    params_per_gpu: int
    weights_gib: float
    grads_gib: float
    optimizer_gib: float
    activations_gib: float
    layout: MegatronConfig  # its offload switches
    active_params: int = 0  # per token (mixture of experts: the top-k experts only)
    expert_params_per_gpu: int = 0
    stage: int = 0  # the most loaded pipeline stage (0-based), whose parameters params_per_gpu counts


@dataclass
class Plan:
    recipe: str
    world_size: int
    layout: str
    roles: dict[str, RolePlan]
    phases_gib: dict[str, float]
    peak_gib: float
    budget_gib: float
    fits: bool
    bubble_fraction: float
    step_time_s: float
    tokens_per_s_per_gpu: float
    problems: list[str]
    all_to_all_gb_per_gpu: float = 0.0  # MoE token dispatch + combine, one iteration, leaving each GPU
    all_to_all_s: float = 0.0  # its time at the assumed bandwidth, included in step_time_s
    kv_cache_gib: float = 0.0  # an evaluation's KV cache per GPU (module docstring)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def micro_batch_rows(config: PPOConfig, role: str, train: bool) -> int:
    """Full-length rows (the longest prompt and response) in one micro-batch of `role`'s update (`train`) or
    experience forward: the configured size, or with `use_dynamic_bsz` as many as the token budget holds,
    ppo_max_token_len_per_gpu // (max_prompt_length + max_response_length) (the reference follows the actor's
    setting, as the experience does)."""
    owner = config.critic if role == "critic" else config.actor
    if owner.use_dynamic_bsz:
        return max(1, owner.ppo_max_token_len_per_gpu // config.data.max_length)
    if train:
        size = getattr(config, role).ppo_micro_batch_size_per_gpu
    else:
        size = {"actor": config.actor.log_prob_micro_batch_size_per_gpu,
                "ref": config.ref.log_prob_micro_batch_size_per_gpu,
                "critic": config.critic.forward_micro_batch_size_per_gpu}[role]  # fmt: skip
    return size or 1


def micro_batch_tokens(config: PPOConfig, role: str, train: bool) -> tuple[int, int]:
    """(tokens, rows) of the largest micro-batch `role`'s pass enters the model with, per CP rank. Packed
    (`model.pack_sequences`) under a token budget (`use_dynamic_bsz`): one `[1, T]` pack, T = the budget
    (packs hold whole sequences of at most that many tokens, `data.batching.packed_micro_batches`), rounded up to
    the pack's step; otherwise rows × padded width: `micro_batch_rows` full-length rows (each sequence padded to the
    layout's multiple; a fixed-size group packed is that many tokens at most). The step: TP with sequence
    parallelism, 2·CP·TP with CP, and `make_sequence_length_divisible_by` where set (`models.widths`; its CUDA
    default of 128 is left out: < 1 % at these widths, and the recipes' budgets are multiples of it)."""
    layout: MegatronConfig = getattr(config, role).megatron
    tp, cp = layout.tensor_model_parallel_size, layout.context_parallel_size
    step = math.lcm((2 * cp if cp > 1 else 1) * (tp if layout.sequence_parallel else 1),
                    layout.make_sequence_length_divisible_by or 1)  # fmt: skip
    owner = config.critic if role == "critic" else config.actor
    if config.model.pack_sequences and owner.use_dynamic_bsz:
        tokens, rows = owner.ppo_max_token_len_per_gpu, 1
    else:
        rows = micro_batch_rows(config, role, train)
        tokens = rows * -(-config.data.max_length // step) * step
    return -(-tokens // step) * step // cp, rows


def micro_batches_per_mini_batch(config: PPOConfig, role: str) -> int:
    """Micro-batches of `role`'s update in one mini-batch on one data-parallel replica, at full-length rows:
    ppo_mini_batch_size / DP rows of (prompt + response) tokens over `micro_batch_tokens`."""
    owner = config.critic if role == "critic" else config.actor
    dp = max(1, data_parallel_size(config, owner.megatron))
    tokens, _ = micro_batch_tokens(config, role, train=True)
    cp = owner.megatron.context_parallel_size
    return max(1, math.ceil(owner.ppo_mini_batch_size / dp * config.data.max_length / cp / tokens))


@dataclass(frozen=True)
class LayerKernels:
    """What the layer implementation that runs saves beyond Transformer Engine's fused layers
    (`layer_activation_bytes`): torch's RMSNorm (the local spec's `LocalNorm`, on any device) keeps x/rms too; the
    unfused SwiGLU (every fusion off: the CPU) keeps silu(gate) and a copy of up; the unfused RoPE (no Transformer
    Engine: its fused RoPE is the only one Megatron finds) keeps cos and sin; a pack through one SDPA call per
    sequence (no varlen kernel: the CPU) keeps each sequence's output beside their concatenation. Measured on the
    CPU (tests/distributed/test_planner_memory.py); the local spec on CUDA is counted as the CPU's norms and RoPE
    with Megatron's fused SwiGLU and the varlen pack path: where torch's RMSNorm runs a fused CUDA kernel that
    keeps less, the plan errs high."""

    local_norms: bool
    unfused_swiglu: bool
    unfused_rope: bool
    per_sequence_pack: bool


TE_KERNELS = LayerKernels(local_norms=False, unfused_swiglu=False, unfused_rope=False, per_sequence_pack=False)
LOCAL_CUDA_KERNELS = LayerKernels(local_norms=True, unfused_swiglu=False, unfused_rope=True, per_sequence_pack=False)
CPU_KERNELS = LayerKernels(local_norms=True, unfused_swiglu=True, unfused_rope=True, per_sequence_pack=True)


def layer_kernels(config: PPOConfig, role: str) -> LayerKernels:
    """The layers `role` runs (`models.gpt.select_layer_spec`): on the CPU the local spec with every fusion off; on
    CUDA the local spec where `model.transformer_impl` is `local` or the role trains LoRA adapters under `auto`,
    else Transformer Engine's (what a GPU cluster's job runs: the planner may run where TE is not installed)."""
    if config.cluster.device == "cpu":
        return CPU_KERNELS
    lora = config.critic.lora if role == "critic" else config.actor.lora
    impl = config.model.transformer_impl
    local = impl == "local" or (impl == "auto" and lora.enabled)
    return LOCAL_CUDA_KERNELS if local else TE_KERNELS


def layer_activation_bytes(
    model: ModelConfig, layout: MegatronConfig, tokens: int, rows: int, *, kernels: LayerKernels, packed: bool
) -> float:
    """Bytes one transformer layer keeps for its backward on one GPU, for a micro-batch of `tokens` tokens (this CP
    rank's) in `rows` rows (1 for a pack), each saved tensor counted once (a saved view holds its base; parameters
    are no activations). Per token, e bytes per element (2 bf16, 4 fp32), h hidden, f FFN size, and per TP rank
    a = heads / TP, g = max(1, query groups / TP), d head size, f_t = f / TP:

        norms   4h·e + 8      both norms' inputs (the residual stream) and outputs (the next GEMM's input), their
                              fp32 1/rms (LayerNorm + 8: the means); ÷ TP with sequence parallelism only
        QKV     (a + 2g)·d·e  the fused QKV output (V, and K without RoPE, are views of it)
                + (a + g)·d·e Q and K after RoPE (without RoPE the query: a copy, a·d·e, when a rank holds more
                              than one group, else a view)
                + a·d·e       the attention output (= the projection's input); flash / fused attention keeps no
                              s × s scores, only its fp32 log-sum-exp, + 4a (not with selective recompute: the core
                              attention is recomputed from Q, K, V)
                + 4(a + g)    QK layernorm (Qwen3): 1/rms per head, and the query copy its norm saves (a·d·e)
        MLP     3·f_t·e       SwiGLU: FC1's gate/up output and FC2's input (GeLU 2·f_t·e; MoE: module docstring)
    and with full recompute h·e (÷ TP with sequence parallelism), each layer's input only.

    Checked on the CPU (tests/distributed/test_planner_memory.py: `torch.autograd.graph.saved_tensors_hooks` on our
    GPTModel, the layer's saves to the byte at TP 2 with and without sequence parallelism, packed and padded, no /
    selective / full recompute). It is Megatron-LM's theoretical_memory_usage.py form s·b·h·(18 + 4·f/h)
    (Korthikanti et al. 2022, Table 2) taken term by term for a Llama/Qwen layer: no dropout masks, GQA's smaller
    K and V, SwiGLU's FC1 output of 2f (Megatron-LM's 4·f/h counts a GeLU MLP's f), no s × s term with flash
    attention. At Qwen2.5-32B's shape (bf16, sequence parallel) it is 47.6·s·b·h / TP bytes, where Megatron-LM's
    form gives 39.6 and the 34 planned before: both short.

    `kernels` (`LayerKernels`, `layer_kernels`): what the implementation that runs keeps beyond Transformer Engine's
    spec, which saves least and is what a GPU recipe plans: TE's norm and fused
    layernorm-linear save x, their output and 1/rms, where torch's RMSNorm on the CPU also keeps x/rms (+ h·e per
    norm; QK layernorm + (a + g)·d·e); Megatron's fused SwiGLU saves FC1's output only, where the unfused one also
    keeps silu(gate) and a copy of up (+ 2·f_t·e); the fused RoPE saves its frequencies, the unfused one cos and sin
    for Q and K (+ 4·d·e per position, not per row); and our SDPA's per-sequence pack path (`models.attention`:
    one call per sequence on views of Q, K, V) saves each sequence's output beside their concatenation, the
    attention output (+ a·d·e), where TE's THD attention writes one output. TE may also copy a strided V; not
    counted."""
    h, ffn = model.hidden_size, model.ffn_hidden_size or 4 * model.hidden_size
    heads, groups = model.num_attention_heads, model.num_query_groups or model.num_attention_heads
    d = model.kv_channels or h // heads
    t, sp = layout.tensor_model_parallel_size, layout.sequence_parallel
    a, g = heads // t, max(1, groups // t)
    e = 4 if model.params_dtype == "fp32" else 2
    if layout.recompute_granularity == "full":
        return tokens * h * e / (t if sp else 1)
    rmsnorm, rope = model.normalization == "RMSNorm", model.position_embedding_type == "rope"
    local_norms = kernels.local_norms and rmsnorm
    norms = 4 * h * e + (8 if rmsnorm else 16) + (2 * h * e if local_norms else 0)
    query_copy = a * d if g > 1 else 0  # Megatron's reshape of a rank's grouped query heads copies them
    qkv = (a + 2 * g) * d + (a * d + g * d if rope else query_copy) + a * d
    selective = layout.recompute_granularity == "selective"
    if kernels.per_sequence_pack and packed and not selective:  # the per-sequence outputs beside their concatenation
        qkv += a * d
    attention = qkv * e + (0 if selective else 4 * a)
    if model.qk_layernorm:
        attention += query_copy * e + 4 * (a + g) + ((a + g) * d * e if local_norms else 0)
    if model.num_experts:
        mlp = model.num_experts_per_tok * (h + 3 * model.moe_intermediate_size) * e / t
    else:
        gated = model.activation == "swiglu"
        mlp = ((3 if gated else 2) + (2 if kernels.unfused_swiglu and gated else 0)) * ffn * e / t
    positions = 4 * d * e / rows if kernels.unfused_rope and rope else 0  # cos and sin of Q and K, per row position
    return tokens * (norms / (t if sp else 1) + attention + mlp + positions)


def _activations_gib(config: PPOConfig, role: str, train: bool) -> float:
    """GiB of `role`'s activations at the peak of its pass on the first pipeline stage (module docstring): a
    training pass keeps each of its layers' saved tensors (`layer_activation_bytes`; with full recompute each
    layer's input, plus one recompute group's whole set while it runs again) for every micro-batch in flight; a
    forward keeps one layer's working set, bounded by what a layer saves. Plus the fp32 log-probs and their gradient
    over the vocabulary slice."""
    m, layout = config.model, getattr(config, role).megatron
    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size
    tokens, rows = micro_batch_tokens(config, role, train)
    kernels, packed = layer_kernels(config, role), m.pack_sequences
    no_recompute = dataclasses.replace(layout, recompute_granularity=None)
    working = layer_activation_bytes(m, no_recompute, tokens, rows, kernels=kernels, packed=packed)
    layers, group = m.num_layers / pp, layout.recompute_num_layers or 1
    if not train:
        per_micro_batch = working
    elif layout.recompute_granularity == "full" and layout.recompute_method == "block":  # the first `group` only
        per_micro_batch = group * layer_activation_bytes(m, layout, tokens, rows, kernels=kernels, packed=packed)
        per_micro_batch += (layers - group) * working
    else:
        per_micro_batch = layers * layer_activation_bytes(m, layout, tokens, rows, kernels=kernels, packed=packed)
    in_flight = 1.0
    if train:
        in_flight = min(pp, micro_batches_per_mini_batch(config, role))
        if vpp and in_flight == pp:  # Megatron-LM's interleaved-schedule penalty (theoretical_memory_usage.py)
            in_flight *= 1 + (pp - 1) / (pp * vpp)
    total = per_micro_batch * in_flight
    if train and layout.recompute_granularity == "full":
        total += working * group
    logits = 2 * 4 * tokens * m.vocab_size / layout.tensor_model_parallel_size  # fp32 log p and its gradient
    return (total + logits) / GIB


def stage_parameters(model: ModelConfig, layout: MegatronConfig, role: str) -> list[tuple[int, int]]:
    """(dense, expert) parameters on one GPU of each pipeline stage, first to last: the stage's L/PP layers —
    their matrices (and QKV bias) split by TP, their norms (and MoE router) replicated, the routed experts split
    by EP × expert-TP — plus on the first stage the input embedding, on the last the final norm and the output
    layer (untied, or with PP > 1 the tied embedding's copy Megatron keeps there; the critic's value head h + 1),
    the vocabulary padded to lcm(make_vocab_size_divisible_by, TP) (`padded_vocab_size`). With virtual stages a
    GPU holds its chunks' layers, L/PP in all, and the embedding / output layer where chunk 0 / the last chunk is."""
    h, a = model.hidden_size, model.num_attention_heads
    g, d = model.num_query_groups or a, model.kv_channels or h // a
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    ep = layout.expert_model_parallel_size
    etp = layout.expert_tensor_parallel_size or tp
    ffn = model.ffn_hidden_size or 4 * h
    split = 2 * h * a * d + 2 * h * g * d + ((a + 2 * g) * d if model.add_qkv_bias else 0)
    replicated = 2 * h + (2 * d if model.qk_layernorm else 0)
    if model.num_experts:
        replicated += model.num_experts * h  # the router
    else:
        split += (3 if model.activation == "swiglu" else 2) * h * ffn
    layers = model.num_layers // pp
    dense = layers * (split // tp + replicated)
    experts = expert_parameter_count(model) // (pp * ep * etp)
    vocab = padded_vocab_size(model, tp) * h // tp
    head = h + 1 if role in ("critic", "reward_model") else vocab
    tied_single = pp == 1 and not model.untie_embeddings_and_output_weights and head == vocab
    first, last = vocab, h + (0 if tied_single else head)
    if pp == 1:
        return [(dense + first + last, experts)]
    return [(dense + first, experts), *[(dense, experts)] * (pp - 2), (dense + last, experts)]


def lora_parameters(model: ModelConfig, layout: MegatronConfig, lora: LoraSettings) -> int:
    """Adapter parameters on one GPU of the most loaded stage (`models.lora`): per layer and target of input width
    `n` and output width `m`, r·n + r·m/TP on a column-parallel layer (A whole, B split), r·n/TP + r·m on a
    row-parallel one (A split, B whole)."""
    h, a = model.hidden_size, model.num_attention_heads
    g, d = model.num_query_groups or a, model.kv_channels or h // a
    tp, r = layout.tensor_model_parallel_size, lora.rank
    ffn = model.ffn_hidden_size or 4 * h
    fc1 = (2 if model.activation == "swiglu" else 1) * ffn
    per_layer = {"linear_qkv": r * h + r * (a + 2 * g) * d // tp, "linear_proj": r * a * d // tp + r * h,
                 "linear_fc1": r * h + r * fc1 // tp, "linear_fc2": r * ffn // tp + r * h}  # fmt: skip
    return model.num_layers // layout.pipeline_model_parallel_size * sum(per_layer[t] for t in lora.target_modules)


def plan_role(config: PPOConfig, role: str) -> RolePlan:
    layout: MegatronConfig = getattr(config, role).megatron
    m = config.model
    # the critic: a value head instead of the vocabulary output layer
    head_swap = m.vocab_size * m.hidden_size - m.hidden_size - 1 if role == "critic" else 0
    params = parameter_count(m) - head_swap
    dp = max(1, data_parallel_size(config, layout))
    _, _, expert_dp = expert_layout(config, layout)
    # the most loaded pipeline stage (Megatron-LM's "most loaded shard"): the last, by its output layer and norm
    stages = stage_parameters(m, layout, role)
    stage = max(range(len(stages)), key=lambda i: sum(stages[i]))
    dense_per_gpu, experts_per_gpu = stages[stage]
    weight_bytes = 4 if config.model.params_dtype == "fp32" else 2
    trained = role != "ref"
    # With LoRA (`<role>.lora`) the base is frozen: gradients and optimizer states are the adapters' (and the
    # critic's value head's, h + 1), and a LoRA actor's reference is its own base: no weights of its own
    lora = config.critic.lora if role == "critic" else config.actor.lora
    adapters = lora_parameters(m, layout, lora) if lora.enabled else 0
    if role == "ref" and lora.enabled:
        dense_per_gpu = experts_per_gpu = 0
    elif adapters:
        dense_per_gpu += adapters
    per_gpu = dense_per_gpu + experts_per_gpu
    trained_dense, trained_experts = dense_per_gpu, experts_per_gpu
    if adapters:
        trained_dense, trained_experts = adapters + (m.hidden_size + 1 if role == "critic" else 0), 0
    grads = 4 * (trained_dense + trained_experts) if trained else 0
    # Adam m and v in fp32, plus fp32 main weights unless the weights are fp32 already (then they are the main ones)
    optimizer_bytes = 8 if config.model.params_dtype == "fp32" else 12
    shards = (dp, expert_dp) if layout.use_distributed_optimizer else (1, 1)
    optimizer = optimizer_bytes * (trained_dense / shards[0] + trained_experts / shards[1]) if trained else 0
    return RolePlan(
        role=role,
        params=params,
        params_per_gpu=per_gpu,
        weights_gib=weight_bytes * per_gpu / GIB,
        grads_gib=grads / GIB,
        optimizer_gib=optimizer / GIB,
        activations_gib=_activations_gib(config, role, train=trained),
        layout=layout,
        active_params=active_parameter_count(m) - head_swap,
        expert_params_per_gpu=experts_per_gpu,
        stage=stage,
    )


def resident_gib(plan: RolePlan, phase: Phase) -> float:
    """GiB of the role's state on the GPU during `phase` (`resident_kinds`), activations aside."""
    sizes = {"params": plan.weights_gib, "grads": plan.grads_gib, "optimizer": plan.optimizer_gib}
    return sum(sizes[kind] for kind in resident_kinds(phase, plan.role, plan.layout))


def phase_gib(config: PPOConfig, roles: dict[str, RolePlan]) -> dict[str, float]:
    """Per-GPU GiB of each phase: the resident state of every role, the activations of the phase's computation
    (the largest forward of the three roles, each at its micro-batch (`micro_batch_rows`), in the experience; the
    trained role's in its update; none between iterations) and the reserved GiB."""
    forward = max(_activations_gib(config, r, train=False) for r in roles)
    activations = {Phase.EXPERIENCE: forward, Phase.UPDATE_CRITIC: roles["critic"].activations_gib,
                   Phase.UPDATE_ACTOR: roles["actor"].activations_gib, Phase.BETWEEN_ITERATIONS: 0.0}  # fmt: skip
    return {
        phase: sum(resident_gib(r, phase) for r in roles.values()) + activations[phase] + RESERVED_GIB
        for phase in PHASE_NEEDS
    }


def kv_cache_gib(config: PPOConfig, rows: int = GENERATION_BATCH_ROWS) -> float:
    """GiB per GPU of the KV cache of `rows` greedy answers at full length (the module docstring's formula; the
    runtime's is `models.generation.kv_cache_bytes`)."""
    m, layout = config.model, config.actor.megatron
    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    groups = m.num_query_groups or m.num_attention_heads
    tokens = config.data.max_prompt_length + config.data.max_response_length
    element = 4 if m.params_dtype == "fp32" else 2
    return 2 * m.num_layers / pp * rows * tokens * max(groups // tp, 1) * head_dim * element / GIB


def plan(config: PPOConfig, recipe: str = "") -> Plan:
    roles = {role: plan_role(config, role) for role in ROLES}
    phases = phase_gib(config, roles)
    peak = max(phases.values())
    budget = gpu_memory_gib(config.cluster) * (1 - MARGIN)
    layout = config.actor.megatron
    pp, vpp = layout.pipeline_model_parallel_size, layout.virtual_pipeline_model_parallel_size or 1
    dp = max(1, data_parallel_size(config, layout))
    micro_batches = micro_batches_per_mini_batch(config, "actor")
    bubble = (pp - 1) / (vpp * micro_batches + pp - 1)
    all_to_all_gb, all_to_all_s = all_to_all_estimate(config)
    step_time, tokens_per_gpu = step_time_estimate(config, roles, bubble, all_to_all_s)
    return Plan(
        recipe=recipe,
        world_size=world_size(config),
        layout=f"TP{layout.tensor_model_parallel_size} PP{pp}"
        + (f" VPP{vpp}" if vpp > 1 else "")
        + f" CP{layout.context_parallel_size} DP{dp}"
        + _expert_layout_text(config, layout),
        roles=roles,
        phases_gib=phases,
        kv_cache_gib=kv_cache_gib(config),
        peak_gib=peak,
        budget_gib=budget,
        fits=peak <= budget,
        bubble_fraction=bubble,
        step_time_s=step_time,
        tokens_per_s_per_gpu=tokens_per_gpu,
        problems=validate(config),
        all_to_all_gb_per_gpu=all_to_all_gb,
        all_to_all_s=all_to_all_s,
    )


def _expert_layout_text(config: PPOConfig, layout: MegatronConfig) -> str:
    if not config.model.num_experts:
        return ""
    ep, etp, expert_dp = expert_layout(config, layout)
    return f" EP{ep} ETP{etp} EDP{expert_dp}"


def all_to_all_estimate(config: PPOConfig) -> tuple[float, float]:
    """(GB each GPU sends in the MoE token all-to-all in one iteration, seconds at the GPU's `all_to_all_gb_s`); (0, 0)
    for a dense model or EP = 1. Per MoE layer, each token's bf16 hidden state (2h bytes) goes to its k experts and the
    results come back (dispatch + combine), and under uniform routing (EP − 1)/EP of the copies leave the GPU; the
    token-layers spread evenly over the world (DP, CP and sequence-parallel TP split the tokens, PP the layers):
        bytes per GPU per pass = T·L / world · k · 2h · 2 · (EP − 1)/EP,   T = train_batch_size · (prompt + response)
    A forward pass does this once, a training pass twice (its backward sends the gradients the same way), three
    times with full recompute; per iteration: one forward of each role, `ppo_epochs` training passes of actor and
    critic. The EP group (ETP·EP consecutive ranks) uses NVLink when it fits in a node, InfiniBand otherwise. The
    time is added to the step, not overlapped with compute (an upper bound)."""
    m = config.model
    if not m.num_experts:
        return 0.0, 0.0
    tokens = config.data.train_batch_size * config.data.max_length
    within, across = gpu_spec(config.cluster.gpu_type).all_to_all_gb_s
    gb = seconds = 0.0
    for role in ROLES:
        role_config = getattr(config, role)
        ep, etp, _ = expert_layout(config, role_config.megatron)
        passes = 1.0
        if role != "ref":
            passes += role_config.ppo_epochs * (3 if role_config.megatron.recompute_granularity == "full" else 2)
        per_pass = tokens * m.num_layers / world_size(config) * m.num_experts_per_tok * 2 * m.hidden_size * 2
        role_gb = passes * per_pass * (ep - 1) / ep / 1e9
        gb += role_gb
        seconds += role_gb / (within if etp * ep <= config.cluster.gpus_per_node else across)
    return gb, seconds


def step_time_estimate(
    config: PPOConfig, roles: dict[str, RolePlan], bubble: float, communication_s: float = 0.0
) -> tuple[float, float]:
    """Seconds and tokens/s per GPU of one iteration of full-length rows (`iteration_flops`) at the assumed MFU,
    plus `communication_s` not overlapped with it (the MoE all-to-all)."""
    seq = config.data.max_length
    tokens = config.data.train_batch_size * seq
    params = {role: flop_parameter_count(config.model, role) for role in roles}
    flops = sum(iteration_flops(config, params, tokens, tokens * seq).values())
    gpus = world_size(config)
    spec = gpu_spec(config.cluster.gpu_type)
    seconds = flops / (gpus * spec.peak_bf16_tflops * 1e12 * spec.assumed_mfu) / (1 - bubble) + communication_s
    return seconds, tokens / seconds / gpus


def suggest(config: PPOConfig) -> tuple[MegatronConfig, Plan] | None:
    """The smallest model-parallel layout (then the least pipeline, then the smallest expert parallelism, then
    offload) that fits the same GPUs."""
    world = world_size(config)
    candidates = []
    for tp, pp, ep, offload in itertools.product(
        (1, 2, 4, 8), (1, 2, 4, 8, 16), _expert_parallel_sizes(config.model, world), (False, True)
    ):
        if world % (tp * pp):
            continue
        layout = dataclasses.replace(
            config.actor.megatron, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=None, sequence_parallel=tp > 1 and config.cluster.device == "cuda",
            use_distributed_optimizer=True, param_offload=offload, grad_offload=offload, optimizer_offload=offload,
            expert_model_parallel_size=ep,
        )  # fmt: skip
        candidate = copy_with_layout(config, layout)
        ep, etp, _ = expert_layout(candidate, layout)
        if world % (etp * ep * pp) or validate(candidate):  # Megatron's expert groups: ETP·EP·PP divides the world
            continue
        result = plan(candidate)
        if result.fits:
            candidates.append((tp * pp, offload, pp, ep, layout, result))
    if not candidates:
        return None
    *_, layout, result = min(candidates, key=lambda c: (c[1], c[0], c[2], c[3]))
    return layout, result


def _expert_parallel_sizes(model: ModelConfig, world: int) -> tuple[int, ...]:
    """EP sizes to try: 1 for a dense model, else the powers of two up to 64 that divide the experts and the world
    (validation then drops those the layout cannot hold)."""
    sizes = (1, 2, 4, 8, 16, 32, 64) if model.num_experts else (1,)
    return tuple(ep for ep in sizes if not (model.num_experts % ep or world % ep))


def copy_with_layout(config: PPOConfig, layout: MegatronConfig) -> PPOConfig:
    """`config` with `layout` for every role (the frozen reference offloads only its weights)."""
    own_weights = not config.actor.lora.enabled  # a LoRA actor's reference is its base: nothing of its own to offload
    frozen_reference = dataclasses.replace(
        layout, grad_offload=False, optimizer_offload=False, param_offload=layout.param_offload and own_weights
    )
    return with_changes(config, {f"{role}.megatron": frozen_reference if role == "ref" else layout for role in ROLES})


def _offload_text(role: RolePlan) -> str:
    return "+".join(kind for kind, on in offload_switches(role.layout).items() if on) or "no"


def _moe_lines(result: Plan, config: PPOConfig) -> list[str]:
    """The mixture-of-experts figures: active parameters, experts per GPU, the all-to-all (none for a dense model)."""
    m = config.model
    if not m.num_experts:
        return []
    actor = result.roles["actor"]
    within, across = gpu_spec(config.cluster.gpu_type).all_to_all_gb_s
    return [
        f"  MoE: {m.num_experts} experts, top-{m.num_experts_per_tok}: {actor.active_params / 1e9:.2f}B of "
        f"{actor.params / 1e9:.2f}B parameters active per token; {actor.expert_params_per_gpu / 1e9:.2f}B expert "
        "parameters per GPU",
        f"  all-to-all {result.all_to_all_gb_per_gpu:.1f} GB per GPU per iteration, {result.all_to_all_s:.1f} s at "
        f"an assumed {within:.0f} GB/s (NVLink) / {across:.0f} GB/s (InfiniBand), not overlapped",
    ]


def format_plan(result: Plan, config: PPOConfig) -> str:
    """A readable report of `result`."""
    lines = [
        f"{result.recipe}: {config.model.name}, {config.cluster.nodes} node(s) × {config.cluster.gpus_per_node} "
        f"{config.cluster.gpu_type} ({result.world_size} GPUs), layout {result.layout}",
        f"{'role':<8}{'params':>10}{'per GPU':>10}{'weights':>10}{'grads':>9}{'optim':>9}{'activ.':>9}  offload",
    ]
    for r in result.roles.values():
        lines.append(
            f"{r.role:<8}{r.params / 1e9:>9.2f}B{r.params_per_gpu / 1e9:>9.2f}B{r.weights_gib:>8.1f}Gi"
            f"{r.grads_gib:>7.1f}Gi{r.optimizer_gib:>7.1f}Gi{r.activations_gib:>7.1f}Gi  {_offload_text(r)}"
        )
    pp = config.actor.megatron.pipeline_model_parallel_size
    if pp > 1:
        stages = ", ".join(f"{r.role} {r.stage + 1}" for r in result.roles.values())
        lines.append(f"  per GPU: the most loaded of the {pp} pipeline stages ({stages}; the first holds the "
                     "embedding, the last the output layer)")  # fmt: skip
    lines += _moe_lines(result, config)
    for phase, gib in result.phases_gib.items():
        lines.append(f"  phase {phase:<14} {gib:7.1f} GiB per GPU (incl. {RESERVED_GIB:.0f} GiB reserved)")
    free = result.budget_gib - result.phases_gib[Phase.BETWEEN_ITERATIONS]
    fit = int(GENERATION_CACHE_SHARE * free / (result.kv_cache_gib / GENERATION_BATCH_ROWS)) if free > 0 else 0
    lines.append(f"  evaluation KV cache {result.kv_cache_gib:.1f} GiB per GPU for {GENERATION_BATCH_ROWS} rows × "
                 f"{config.data.max_prompt_length + config.data.max_response_length} tokens; greedy answers decode "
                 f"{min(fit, GENERATION_BATCH_ROWS)} rows at a time (the cache takes at most "
                 f"{GENERATION_CACHE_SHARE:.0%} of the {max(free, 0):.1f} GiB left between iterations)")  # fmt: skip
    verdict = "fits" if result.fits else "does NOT fit"
    lines.append(
        f"peak {result.peak_gib:.1f} GiB of {result.budget_gib:.1f} GiB usable ({MARGIN:.0%} margin): {verdict}"
    )
    spec = gpu_spec(config.cluster.gpu_type)
    lines.append(f"pipeline bubble {result.bubble_fraction:.1%}; estimated step {result.step_time_s:.1f} s, "
                 f"{result.tokens_per_s_per_gpu:,.0f} tokens/s per GPU at MFU {spec.assumed_mfu:.0%}")  # fmt: skip
    lines.append(f"  ({spec.mfu_anchor}; see docs/planner.md)")
    lines += [f"problem: {p}" for p in result.problems]
    return "\n".join(lines)
