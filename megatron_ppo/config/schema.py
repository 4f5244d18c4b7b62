"""The typed shape of a megatron-ppo config: one dataclass per group, verl's leaf names where verl has them.

Top level: model, data, actor, ref, critic, algorithm, reward, reward_model, guards, trainer, cluster, profiling.
Each role (actor, ref, critic) has a `megatron` section (its parallel layout); the trained roles also have an `optim`
section — the shape of verl's Megatron config, so `actor_rollout_ref.actor.*` paths map onto `actor.*`.
Each field carries its own rule (`choice`: the values it may take; `ranged`: its valid range), which
`validate.py` walks; rules across keys (batch divisibility, layouts, KL stages) live in `validate.py`. Every section
is `Freezable`: once validated, the config is read-only (`frozen.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ppo.algo.advantages import ADV_ESTIMATORS, ROLLOUT_ONLY_ESTIMATORS
from megatron_ppo.algo.aggregation import LOSS_AGGREGATIONS
from megatron_ppo.algo.kl import KL_PENALTY_CHOICES
from megatron_ppo.algo.kl_control import KL_CONTROLLERS
from megatron_ppo.algo.kl_schedule import WARMUP
from megatron_ppo.algo.policy_loss import POLICY_LOSSES
from megatron_ppo.algo.rollout_correction import ROLLOUT_IS_LEVELS
from megatron_ppo.config.fields import (
    AT_LEAST_ONE,
    COEFFICIENT,
    FACTOR,
    NON_NEGATIVE,
    PER_JOB,
    POSITIVE,
    UNIT_INTERVAL,
    Range,
    choice,
    described,
    each_of,
    per_job,
    ranged,
    shared_layout,
)
from megatron_ppo.config.frozen import Freezable
from megatron_ppo.config.gpus import GPU_SPECS

BETA = Range(lambda v: 0 <= v < 1, "in [0, 1)")
CLIP_GRAD = Range(lambda v: v >= 0, "≥ 0 (0 turns clipping off)")
CLIP_LOW = Range(lambda v: 0 < v < 1, "in (0, 1) (the ratio is clipped at 1 − low)")
DUAL_CLIP = Range(lambda v: v > 1, "> 1 (dual clip caps −A·ρ at −A·c; try 3.0)")
SPIKE_FACTOR = Range(lambda v: v > 1, "> 1 (a multiple of the running grad norm)")
ROPE_FACTOR = Range(lambda v: v >= 1, "≥ 1 (Llama 3.1: 8), or null: off")
SAVE_FREQ = Range(lambda v: v >= -1, "≥ -1 (-1: never, 0: only at the end)")
OFF_OR_POSITIVE = Range(lambda v: v > 0, "> 0 (or null: off)")
ROLES = ("actor", "ref", "critic")
TRAINED_ROLES = ("actor", "critic")  # the roles with an optimizer; the reference is frozen
# Why the jobs of one run may set a key differently (`per_job`; `run_identity.meant_to_change`): how a job runs,
# where it writes and when it stops; the run's length (the KL schedule refuses, on load, a length that moves its
# stage ends, with its own message; the learning-rate schedule follows it); how the work is cut into micro-batches
# (the same training).
RUN_CONTROL = "run control"
RUN_LENGTH = "the run's length"
MICRO_BATCHING = "micro-batching"


@dataclass
class ModelConfig(Freezable):
    """GPT architecture shared by actor, critic trunk and reference (Megatron `TransformerConfig` names)."""

    name: str = described("tiny", "a name for the model in logs and the planner's table (configs/models/* set it)")
    num_layers: int = ranged(2, AT_LEAST_ONE, "transformer layers")
    hidden_size: int = ranged(128, AT_LEAST_ONE, "width of the residual stream")
    ffn_hidden_size: int | None = ranged(
        None, AT_LEAST_ONE, "MLP width; null: 4 × hidden_size (gelu) or Megatron's SwiGLU default"
    )
    num_attention_heads: int = ranged(4, AT_LEAST_ONE, "query heads")
    num_query_groups: int | None = ranged(
        None,
        AT_LEAST_ONE,
        "key/value heads for grouped-query attention; null: multi-head attention (= num_attention_heads)",
    )
    kv_channels: int | None = ranged(
        None, AT_LEAST_ONE, "head size; null: hidden_size / num_attention_heads (Qwen3 sets it)"
    )
    vocab_size: int = ranged(
        256, AT_LEAST_ONE, "the tokenizer's vocabulary size (padded by make_vocab_size_divisible_by inside the model)"
    )
    max_position_embeddings: int = ranged(512, AT_LEAST_ONE, "longest sequence the position embedding covers")
    position_embedding_type: str = choice(
        "rope", ("rope", "learned_absolute"), "rotary (RoPE) or learned absolute position embeddings"
    )
    rotary_base: float = described(10000.0, "RoPE base θ (Llama 3.1: 500000, Qwen2.5: 1000000)")
    rope_scaling_factor: float | None = ranged(
        None, ROPE_FACTOR, "Llama 3.1 RoPE scaling (rope_type llama3; Llama 3.1: 8); null: off"
    )
    normalization: str = choice("RMSNorm", ("RMSNorm", "LayerNorm"), "the norm of every layer")
    layernorm_epsilon: float = described(1.0e-6, "ε of every norm")
    activation: str = choice("swiglu", ("swiglu", "gelu"), "MLP activation (swiglu: gated, Llama/Qwen)")
    add_qkv_bias: bool = described(False, "biases on the query/key/value projection (Qwen2)")
    qk_layernorm: bool = described(False, "normalization of each query and key head before RoPE (Qwen3)")
    add_bias_linear: bool = described(False, "biases on the other linear layers (GPT-2 style); Llama/Qwen have none")
    untie_embeddings_and_output_weights: bool = described(
        True, "a separate output layer; false: the input embedding is reused (tied)"
    )
    params_dtype: str = choice(
        "bf16", ("bf16", "fp16", "fp32"), "dtype of weights and activations (bf16 on GPUs; the CPU recipes run fp32)"
    )
    init_method_std: float = described(0.02, "standard deviation of the random initial weights (random init only)")
    make_vocab_size_divisible_by: int = ranged(
        128,
        AT_LEAST_ONE,
        "the vocabulary is padded to a multiple of this (lcm with TP); padded logits are masked out of every log-prob",
    )
    transformer_impl: str = choice(
        "auto",
        ("auto", "local", "transformer_engine"),
        "layer spec: auto (Transformer Engine where it imports on CUDA, else Megatron's local spec with SDPA), "
        "local, or transformer_engine (GPU only)",
    )
    use_cpu_initialization: bool = described(
        False,
        "CUDA: draw full weights on the host, then split them (the same initial weights for every TP layout, slow "
        "for large models); the CPU path always does",
    )
    logprob_chunk_tokens: int | None = ranged(
        2048,
        AT_LEAST_ONE,
        "log-probs and entropy over [tokens, vocab/TP] in chunks of this many tokens, fp32 per chunk, recomputed in "
        "the backward; null: all tokens at once",
    )
    pack_sequences: bool = described(
        False,
        "packed sequences (THD; verl's use_remove_padding) in every pass of actor, reference and critic: one [1, T] "
        "row of whole sequences per micro-batch; not with context parallelism",
    )
    hf_checkpoint: str | None = described(
        None, "Hugging Face directory converted on first use (cached in <trainer.default_local_dir>/hf_init)"
    )
    init_checkpoint: str | None = described(
        None, "megatron-ppo checkpoint whose actor initialises actor, reference and critic trunk"
    )
    allow_random_init: bool = described(
        False, "allow a dataset run without initial weights (smoke tests, benchmarks only)"
    )
    tokenizer: str | None = described(None, "sentencepiece .model, or a Hugging Face tokenizer.json or directory")
    num_experts: int = ranged(
        0, NON_NEGATIVE, "mixture of experts: experts per layer (Hugging Face Qwen3-MoE names); 0: dense"
    )
    num_experts_per_tok: int = ranged(0, NON_NEGATIVE, "experts each token is routed to (top-k)")
    moe_intermediate_size: int = ranged(0, NON_NEGATIVE, "each expert's FFN width")
    norm_topk_prob: bool = described(True, "renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE: true)")
    router_aux_loss_coef: float = ranged(
        0.0,
        COEFFICIENT,
        "the router's load-balancing loss (Switch Transformer's) times this, added to the actor's loss",
    )
    moe_token_dispatcher: str = choice(
        "allgather",
        ("allgather", "alltoall"),
        "how tokens reach the experts of other expert-parallel ranks: allgather (CPU and GPU) or alltoall (GPU only)",
    )


@dataclass
class MegatronConfig(Freezable):
    """Parallel layout of one role (verl: `actor_rollout_ref.actor.megatron.*`)."""

    tensor_model_parallel_size: int = shared_layout(ranged(1, AT_LEAST_ONE, "tensor parallel size (TP)"))
    pipeline_model_parallel_size: int = shared_layout(ranged(1, AT_LEAST_ONE, "pipeline parallel size (PP)"))
    virtual_pipeline_model_parallel_size: int | None = ranged(
        None, AT_LEAST_ONE, "virtual pipeline stages per rank (the interleaved schedule); null: none"
    )
    context_parallel_size: int = shared_layout(
        ranged(
            1,
            AT_LEAST_ONE,
            "context parallel size (CP): each sequence split over this many ranks (needs Transformer Engine attention)",
        )
    )
    expert_model_parallel_size: int = shared_layout(
        ranged(
            1,
            AT_LEAST_ONE,
            "expert parallel size (EP): experts split over this many ranks, carved out of the data-parallel × "
            "context-parallel ranks",
        )
    )
    expert_tensor_parallel_size: int | None = shared_layout(
        ranged(None, AT_LEAST_ONE, "each expert's tensor parallel size; null: the same as TP")
    )
    sequence_parallel: bool = described(False, "Megatron's sequence parallelism (needs TP > 1)")
    use_distributed_optimizer: bool = described(False, "shard optimizer states over the data-parallel ranks")
    recompute_granularity: str | None = choice(
        None,
        (None, "full", "selective"),
        "activation recompute: full (every layer's inside) or selective (attention core); null: none",
    )
    recompute_method: str | None = choice(
        None, (None, "uniform", "block"), "how full recompute picks layers: uniform or block"
    )
    recompute_num_layers: int | None = ranged(
        None, AT_LEAST_ONE, "layers per recompute group (uniform) or recomputed layers per stage (block)"
    )
    make_sequence_length_divisible_by: int | None = ranged(
        None,
        AT_LEAST_ONE,
        "micro-batch widths rounded up to a multiple of this (lcm with the layout's own); null: 128 on CUDA, 1 on "
        "CPU; its cost is perf/padded_over_real_tokens",
    )
    param_offload: bool = described(
        False, "keep this role's weights in (pinned) host memory outside the phases that need them (verl's switch)"
    )
    optimizer_offload: bool = described(False, "keep this role's optimizer states in host memory outside its update")
    grad_offload: bool = described(False, "keep this role's gradients in host memory outside its update")


@dataclass
class OptimConfig(Freezable):
    """Optimizer and learning-rate schedule of one trained role (verl: `actor_rollout_ref.actor.optim.*`)."""

    optimizer: str = choice("adam", ("adam", "sgd"), "adam (AdamW; TE's or apex's fused Adam where they import) or sgd")
    lr: float = ranged(1.0e-6, POSITIVE, "peak learning rate")
    min_lr: float = ranged(0.0, NON_NEGATIVE, "the learning rate the decay ends at")
    lr_warmup_steps: int | None = ranged(
        None, NON_NEGATIVE, "linear warm-up steps; wins over lr_warmup_steps_ratio when set"
    )
    lr_warmup_steps_ratio: float = ranged(0.0, UNIT_INTERVAL, "linear warm-up as a fraction of the run's steps")
    lr_decay_style: str = choice("constant", ("constant", "linear", "cosine"), "learning-rate decay after the warm-up")
    weight_decay: float = ranged(0.01, NON_NEGATIVE, "decoupled weight decay")
    adam_beta1: float = ranged(0.9, BETA, "Adam β₁")
    adam_beta2: float = ranged(0.999, BETA, "Adam β₂")
    adam_eps: float = described(1.0e-8, "Adam ε")
    clip_grad: float = ranged(1.0, CLIP_GRAD, "gradient-norm clipping of this role (0: off)")


@dataclass
class AdditionTaskConfig(Freezable):
    """The embedded demo task (data.task=addition): prompts, SFT of the initial policy, the sampled dataset."""

    num_prompts: int = described(2000, "training prompts of the addition task")
    num_heldout: int = described(200, "held-out prompts the evaluation scores")
    samples_per_prompt: int = described(4, "responses sampled from the SFT policy per prompt (the offline dataset)")
    sample_temperature: float = described(1.0, "temperature of that sampling")
    sft_steps: int = described(1000, "steps of the SFT warm start")
    sft_batch_size: int = described(128, "rows per SFT step")
    sft_lr: float = described(2.0e-3, "SFT learning rate")
    work_dir: str = described(
        "outputs/tiny", "the task cache: one task-<hash> folder per task setting, seed and model shape"
    )


@dataclass
class DataConfig(Freezable):
    """Offline dataset: rows of (prompt, response, reward) and how they are batched."""

    train_files: list[str] = described(
        default_factory=list, doc="training rows: .jsonl or .parquet files (one path or a list)"
    )
    val_files: list[str] = described(default_factory=list, doc="evaluation rows, same formats")
    format: str = choice("auto", ("auto", "jsonl", "parquet"), "file format; auto: from the file extension")
    prompt_key: str = described("prompt", "the prompt's column (text or chat messages)")
    response_key: str = described("response", "the response's column")
    reward_key: str = described("reward", "the sequence reward's column")
    max_prompt_length: int = ranged(64, AT_LEAST_ONE, "longest prompt in tokens")
    max_response_length: int = ranged(64, AT_LEAST_ONE, "longest response in tokens (eos included)")
    overlong_policy: str = choice(
        "filter",
        ("filter", "truncate", "error"),
        "a row over a limit is dropped and counted (filter), cut (truncate) or an error naming the row (error)",
    )
    prompt_truncation: str = choice(
        "left",
        ("left", "right", "middle"),
        "which prompt tokens truncation keeps (verl's data.truncation): the last (left is cut), the first (right) or "
        "both halves (middle)",
    )
    on_bad_row: str = choice(
        "error",
        ("error", "skip"),
        "a malformed row stops the run naming its file and line (error), or goes to a rejects file with its reason "
        "(skip)",
    )
    tokenization_check: str = choice(
        "warn",
        ("strict", "warn", "off"),
        "text rows tokenized apart vs together (verl's tokenization_sanity_check_mode): strict rejects a differing "
        "row, warn counts it, off skips",
    )
    chosen_key: str = described(
        "chosen", "preference pairs: the chosen response's column (a pair becomes two rows sharing a group id)"
    )
    rejected_key: str = described("rejected", "preference pairs: the rejected response's column")
    chosen_score_key: str = described(
        "chosen_score", "pair_reward=given: the chosen response's score column (UltraFeedback's)"
    )
    rejected_score_key: str = described("rejected_score", "pair_reward=given: the rejected response's score column")
    pair_reward: str = choice(
        "model",
        ("model", "given", "preference"),
        "a pair's rewards: from a reward model (`megatron-ppo score`), given in the score columns, or +1/−1 from the "
        "preference itself",
    )
    train_batch_size: int = ranged(512, AT_LEAST_ONE, "rows per PPO iteration")
    shuffle: bool = described(True, "shuffle the rows each epoch")
    seed: int = described(1, "the shuffle's seed")
    prepared_dir: str | None = per_job(
        None,
        RUN_CONTROL,
        "where the rows are prepared once (checked, scored, tokenized into files every rank reads) and found again, "
        "one folder per data key; null: <trainer.default_local_dir>/prepared. A folder shared by several runs "
        "prepares each dataset once",
    )
    task: str | None = choice(
        None,
        (None, "addition"),
        "addition: build the tiny recipe's data (tokenizer, SFT policy, sampled rows) first; null: read data files",
    )
    addition: AdditionTaskConfig = field(default_factory=AdditionTaskConfig)

    @property
    def max_length(self) -> int:
        """The longest row in tokens: max_prompt_length + max_response_length."""
        return self.max_prompt_length + self.max_response_length


@dataclass
class PolicyLossSettings(Freezable):
    """Which policy loss the actor trains with, and the settings of those that have their own (verl
    `actor_rollout_ref.actor.policy_loss.*`; `megatron_ppo.algo.policy_loss` gives each loss's equation)."""

    loss_mode: str = choice(
        "vanilla",
        tuple(POLICY_LOSSES),
        "the policy loss (verl's registry names; algo/policy_loss.py gives each equation)",
    )
    clip_cov_ratio: float = ranged(0.0002, POSITIVE, "clip_cov: share of tokens whose gradient is cut")
    clip_cov_lb: float = described(1.0, "clip_cov: lower end of the covariance band the cut tokens are drawn from")
    clip_cov_ub: float = described(5.0, "clip_cov: upper end of that band")
    kl_cov_ratio: float = ranged(0.0002, POSITIVE, "kl_cov: share of tokens with the |log ρ| penalty")
    ppo_kl_coef: float = ranged(0.1, COEFFICIENT, "kl_cov: that penalty's coefficient")
    dro_beta: float | None = ranged(None, POSITIVE, "dro: the quadratic log-ratio penalty (required for dro)")


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass
class RouterReplaySettings(Freezable):
    """MoE routing replay (verl `actor_rollout_ref.actor.router_replay.*`; `models.router_replay`): the update's
    forwards send each token to the experts it went to in an earlier pass, so π_θ/π_old compares one network.
    R2: the experts of the old-log-prob pass; R3: the behaviour policy's, from the rows' `routed_experts`."""

    mode: str = choice(
        "disabled",
        ROUTER_REPLAY_MODES,
        "MoE routing replay: R2 replays the old-log-prob pass's experts, R3 the behaviour policy's (rows' "
        "routed_experts)",
    )


LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")  # Megatron's names (verl's Megatron LoRA)


@dataclass
class LoraSettings(Freezable):
    """LoRA adapters on the role's linear layers (verl `actor_rollout_ref.model.lora.*`, `critic.model.lora.*`;
    `models.lora`): the base frozen, W x + (alpha / rank) · B A x trained; for the actor, the reference is its base
    with the adapters off (no third model)."""

    rank: int = ranged(0, NON_NEGATIVE, "adapter rank r; 0: off (a full fine-tune); verl's lora_rank")
    alpha: float = ranged(16.0, POSITIVE, "the adapters' update is scaled by alpha / rank")
    dropout: float = ranged(0.0, Range(lambda v: 0 <= v < 1, "in [0, 1)"), "dropout on the adapter's input only")
    target_modules: list[str] = described(
        default_factory=lambda: list(LORA_TARGETS),
        doc="the linear layers that get adapters: QKV, attention output, FC1 (gate and up), FC2 (down); the experts' "
        "layers are not supported",
        **each_of(LORA_TARGETS),
    )
    merge: bool = described(False, "`convert mcore-to-hf` writes merged Hugging Face weights instead of a peft adapter")

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class ActorConfig(Freezable):
    """The trained policy: PPO objective (verl `actor_rollout_ref.actor.*` leaves), layout and optimizer."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = ranged(128, AT_LEAST_ONE, "rows per optimizer step (a divisor of data.train_batch_size)")
    ppo_micro_batch_size_per_gpu: int | None = per_job(
        ranged(16, AT_LEAST_ONE, "rows per forward/backward pass on one data-parallel rank"), MICRO_BATCHING
    )
    log_prob_micro_batch_size_per_gpu: int | None = per_job(
        ranged(None, AT_LEAST_ONE, "rows per pass when computing old log-probs; null: ppo_micro_batch_size_per_gpu"),
        MICRO_BATCHING,
    )
    use_dynamic_bsz: bool = per_job(
        False, MICRO_BATCHING, "micro-batches by a token budget (ppo_max_token_len_per_gpu) instead of a row count"
    )
    ppo_max_token_len_per_gpu: int = per_job(
        ranged(16384, AT_LEAST_ONE, "that token budget per micro-batch"), MICRO_BATCHING
    )
    ppo_epochs: int = ranged(1, AT_LEAST_ONE, "passes over each iteration's batch")
    clip_ratio: float = ranged(0.2, POSITIVE, "PPO clip ε; the default of clip_ratio_low and clip_ratio_high")
    clip_ratio_low: float | None = ranged(
        None,
        CLIP_LOW,
        "lower clip: the ratio is clipped at 1 − low; null: clip_ratio (verl defaults it to 0.2, hiding clip_ratio)",
    )
    clip_ratio_high: float | None = ranged(
        None, POSITIVE, "upper clip: the ratio is clipped at 1 + high; null: clip_ratio"
    )
    clip_ratio_c: float = ranged(3.0, DUAL_CLIP, "dual clip: caps −A·ρ at −A·c for negative advantages")
    policy_loss: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    tau_pos: float = ranged(1.0, POSITIVE, "sapo: gate temperature where A > 0")
    tau_neg: float = ranged(1.05, POSITIVE, "sapo: gate temperature where A ≤ 0")
    use_kl_loss: bool = described(True, "add β·KL(actor‖ref) to the actor's loss")
    kl_loss_coef: float = ranged(0.001, COEFFICIENT, "the KL loss's β (its start, when a controller moves it)")
    kl_loss_type: str = choice(
        "low_var_kl", KL_PENALTY_CHOICES, "KL estimator of the KL loss (k1, k2, k3 = low_var_kl, …)"
    )
    entropy_coeff: float = ranged(0.0, COEFFICIENT, "entropy bonus coefficient")
    loss_agg_mode: str = choice(
        "token-mean", tuple(LOSS_AGGREGATIONS), "how token losses are averaged, normalised by global mini-batch counts"
    )
    loss_scale_factor: int | None = ranged(
        None, AT_LEAST_ONE, "seq-mean-token-sum-norm divisor; null: data.max_response_length"
    )
    router_replay: RouterReplaySettings = field(default_factory=RouterReplaySettings)  # MoE only
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class RefConfig(Freezable):
    """The frozen reference policy: only a layout."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    log_prob_micro_batch_size_per_gpu: int | None = per_job(
        ranged(None, AT_LEAST_ONE, "rows per pass of the reference; null: actor.log_prob_micro_batch_size_per_gpu"),
        MICRO_BATCHING,
    )


@dataclass
class CriticModelConfig(Freezable):
    """The critic's own initial weights (verl: `critic.model.path`); unset: the actor's trunk and a zero head.
    A reward model is a common start: the value head takes a sequence-classification model's one-label `score`."""

    hf_checkpoint: str | None = described(
        None,
        "Hugging Face directory converted on first use (verl's critic.model.path); a one-label sequence classifier "
        "also gives the value head its score",
    )
    init_checkpoint: str | None = described(
        None, "megatron-ppo checkpoint: its critic if it saved one, else its actor trunk"
    )


@dataclass
class CriticConfig(Freezable):
    """The value model (a GPT trunk with a scalar head)."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1.0e-5))
    lora: LoraSettings = field(default_factory=LoraSettings)  # the value head is trained whole
    ppo_mini_batch_size: int = ranged(128, AT_LEAST_ONE, "rows per critic optimizer step")
    ppo_micro_batch_size_per_gpu: int | None = per_job(
        ranged(16, AT_LEAST_ONE, "rows per forward/backward pass on one data-parallel rank"), MICRO_BATCHING
    )
    forward_micro_batch_size_per_gpu: int | None = per_job(
        ranged(
            None, AT_LEAST_ONE, "rows per pass computing values in the experience; null: ppo_micro_batch_size_per_gpu"
        ),
        MICRO_BATCHING,
    )
    use_dynamic_bsz: bool = per_job(False, MICRO_BATCHING, "micro-batches by a token budget instead of a row count")
    ppo_max_token_len_per_gpu: int = per_job(
        ranged(16384, AT_LEAST_ONE, "that token budget per micro-batch"), MICRO_BATCHING
    )
    ppo_epochs: int = ranged(1, AT_LEAST_ONE, "passes over each iteration's batch")
    cliprange_value: float = ranged(0.5, POSITIVE, "value clipping around the old values")
    loss_agg_mode: str = choice("token-mean", tuple(LOSS_AGGREGATIONS), "how token value losses are averaged")
    loss_scale_factor: int | None = ranged(
        None, AT_LEAST_ONE, "seq-mean-token-sum-norm divisor; null: actor.loss_scale_factor"
    )


# the PI rule's most change of β in one step, as a factor (β within [β/r, β·r] per step)
RATE_LIMIT = Range(lambda v: v > 1, "> 1 (β's largest change in one step, as a factor)")
# the KL the controllers read: `kl/mean`, the update's `actor/ref_kl`, or `kl/probe_mean` (train/kl_probe.py)
KL_FEEDBACK = ("experience", "update", "probe")


@dataclass
class KLStageConfig(Freezable):
    """One phase of a staged KL schedule; `end` in `kl_ctrl.stage_unit` (fraction of the run, or step)."""

    name: str = described("stage", "the stage's name (logged as kl/stage, drawn on the figure)")
    end: float = described(1.0, "where the stage ends, in kl_ctrl.stage_unit (a fraction of the run, or a step)")
    controller: str = choice(
        "power_law",
        (WARMUP, *KL_CONTROLLERS),
        "the stage's rule: warmup (KL off, β ramps to its start), fixed, adaptive, power_law, band or pi",
    )
    target_kl: float | None = described(None, "the stage's KL target in nats per token")
    band: list[float] | None = described(None, "[low, high] for the band rule; null: [target/1.5, target·1.5]")
    horizon: float = described(10000.0, "adaptive: Ziegler's horizon")
    alpha: float = described(1.5, "power_law: the exponent α of β ← β·(KL/target)^α")
    kp: float = described(1.0, "pi: proportional gain, Δlog β per unit change of log KL")
    ki: float = described(0.5, "pi: integral gain, Δlog β per unit of log(KL/target)")
    rate_limit: float = described(2.0, "pi: β's largest change in one step, as a factor")
    guards: dict[str, float] = described(default_factory=dict, doc="overrides of guards.* thresholds in this stage")


@dataclass
class KLControlConfig(Freezable):
    """How β moves (verl `algorithm.kl_ctrl`). It drives the coefficients listed in `apply_to` that are enabled:
    `loss` starts from `actor.kl_loss_coef`, `reward` from `kl_coef`; a term not listed keeps its coefficient."""

    type: str = choice(
        "fixed",
        (*KL_CONTROLLERS, "staged"),
        "how β moves: fixed, adaptive (Ziegler), power_law, band, pi, or staged (stages below)",
    )
    kl_coef: float = ranged(0.001, COEFFICIENT, "the reward KL's β (its start)")
    target_kl: float = ranged(0.1, POSITIVE, "KL target in nats per token (adaptive, power_law, band, pi)")
    horizon: float = ranged(10000.0, POSITIVE, "adaptive: Ziegler's horizon")
    alpha: float = ranged(1.5, POSITIVE, "power_law: the exponent α")
    band: list[float] | None = described(None, "band: [low, high]; null: [target/1.5, target·1.5]")
    kp: float = ranged(1.0, COEFFICIENT, "pi: proportional gain, Δlog β per unit change of log KL")
    ki: float = ranged(0.5, POSITIVE, "pi: integral gain, Δlog β per unit of log(KL/target)")
    rate_limit: float = ranged(2.0, RATE_LIMIT, "pi: β's largest change in one step, as a factor")
    feedback: str = choice(
        "experience",
        KL_FEEDBACK,
        "the KL every controller reads: experience (kl/mean, the policy before this iteration's update, verl's "
        "input), update (actor/ref_kl, the update's own KL: one iteration fresher) or probe (kl/probe_mean, the "
        "policy after the update on probe_rows fixed rows: no row-sampling noise step to step)",
    )
    probe_rows: int = ranged(
        2048, AT_LEAST_ONE, "feedback: probe: the fixed training rows the KL is measured on after each update"
    )
    min_coef: float = ranged(1.0e-6, COEFFICIENT, "lowest β")
    max_coef: float = described(1.0, "highest β")
    apply_to: list[str] = described(
        default_factory=lambda: ["loss", "reward"],
        doc="the KL terms the controller drives (loss, reward), among those enabled",
    )
    stage_unit: str = choice(
        "fraction", ("fraction", "step"), "the unit of the stages' end: fraction of the run or step"
    )
    stages: list[KLStageConfig] = described(
        default_factory=list, doc="the staged schedule's stages, in order, covering the run"
    )


@dataclass
class RolloutCorrectionConfig(Freezable):
    """Off-policy correction against the behaviour policy whose log-probs the rows carry (verl
    `algorithm.rollout_correction.*`; `megatron_ppo.algo.rollout_correction`). Rows with behaviour log-probs always
    log the `rollout_corr/*` diagnostics; weights and rejection apply only when set here."""

    rollout_is: str | None = choice(
        None,
        (None, *ROLLOUT_IS_LEVELS),
        "importance weights against the behaviour log-probs, per token or sequence; null: none",
    )
    rollout_is_threshold: str = described(
        "2.0", 'a number: truncate the weights there (TIS); "lower_upper": zero them outside the band (IcePop)'
    )
    rollout_is_batch_normalize: bool = described(False, "divide the weights by their batch mean")
    rollout_rs: str | None = described(
        None,
        "rejection: comma-separated token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3 (all must pass); null: "
        "none",
    )
    rollout_rs_threshold: str | None = described(
        None, 'one threshold for all rollout_rs options or one per option; "lower_upper" for *_k1'
    )
    min_eff_sample_size: float = ranged(
        0.5,
        UNIT_INTERVAL,
        "the start warns when the token weights' effective sample size, or the share inside [1/threshold, "
        "threshold], is below this",
    )


@dataclass
class AlgorithmConfig(Freezable):
    """Advantage estimation and KL in the reward (verl `algorithm.*`)."""

    adv_estimator: str = choice(
        "gae",
        (*ADV_ESTIMATORS, *ROLLOUT_ONLY_ESTIMATORS),
        "advantage estimator (verl's names); rollout-only ones are refused with the reason",
    )
    gamma: float = ranged(1.0, UNIT_INTERVAL, "discount γ")
    lam: float = ranged(0.95, UNIT_INTERVAL, "GAE λ")
    norm_adv_by_std_in_grpo: bool = described(True, "GRPO: divide advantages by the group's standard deviation")
    use_kl_in_reward: bool = described(False, "subtract β·KL(old‖ref) per token from the reward")
    kl_penalty: str = choice("kl", KL_PENALTY_CHOICES, "KL estimator of the reward KL")
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class CustomRewardFnConfig(Freezable):
    """A user score function (verl's `custom_reward_function`): `name(data_source=, solution_str=, ground_truth=,
    extra_info=)` → a number, or a dict with a "score"."""

    path: str | None = described(
        None, "the .py file defining the score function; a path alone selects reward.score_fn=custom"
    )
    name: str = described(
        "compute_score", "the function's name: name(data_source=, solution_str=, ground_truth=, extra_info=)"
    )


@dataclass
class RewardConfig(Freezable):
    """Scoring of rows that carry no reward, then sequence-reward shaping before it is placed on the last token."""

    score_fn: str | None = choice(
        None,
        (None, "verl", "custom"),
        "score rows that carry no reward when they are read: verl's default_compute_score, or custom_fn; null: rows "
        "carry rewards",
    )
    custom_fn: CustomRewardFnConfig = field(default_factory=CustomRewardFnConfig)
    clip_range: list[float] | None = described(None, "[low, high] the sequence reward is clipped to; null: no clipping")
    normalize: bool = described(False, "running mean/std normalisation over all rewards seen")


@dataclass
class RewardModelWeightsConfig(Freezable):
    """The reward model `megatron-ppo score` runs (verl: `reward_model.model.*`): one of the two, its architecture
    its own (not `model.*`)."""

    path: str | None = described(
        None,
        "a Hugging Face *ForSequenceClassification directory with one label, converted on first use (verl's "
        "reward_model.model.path)",
    )
    init_checkpoint: str | None = described(
        None, "a megatron-ppo checkpoint holding a value head (a PPO run's critic, or a converted reward model)"
    )
    tokenizer: str | None = described(None, "the reward model's tokenizer; null: model.tokenizer")


@dataclass
class RewardModelConfig(Freezable):
    """Scoring rows with a reward model before PPO (`megatron-ppo score`, `convert/reward_scoring.py`): forward-only
    under its own layout over every row of data.train_files / data.val_files; the reward is the value head at the
    row's last token, as transformers' sequence classifiers score."""

    model: RewardModelWeightsConfig = field(default_factory=RewardModelWeightsConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # TP/PP of the scoring job; DP = the rest
    micro_batch_size_per_gpu: int = ranged(16, AT_LEAST_ONE, "rows per forward pass (verl's name)")
    use_dynamic_bsz: bool = described(False, "micro-batches by a token budget instead of a row count")
    forward_max_token_len_per_gpu: int = ranged(16384, AT_LEAST_ONE, "that token budget (verl's name)")
    output_dir: str | None = described(
        None, "where the scored Parquet files go, as <input stem>.scored.parquet; null: beside each input"
    )


@dataclass
class WatchConfig(Freezable):
    """A watched metric: when `metric` first rises above `max` (and again after it has come back under), the run
    logs a guard event and does `action` (warn only, back off every learning rate, or bump every KL β)."""

    metric: str = described("actor/ref_kl", "the watched metric (a TensorBoard tag)")
    max: float = described(0.05, "the threshold it must stay under")
    action: str = choice(
        "warn",
        ("warn", "lr_backoff", "kl_bump"),
        "what a crossing does: warn, back off every learning rate, or bump every KL β",
    )


def _default_watch() -> list[WatchConfig]:
    return [WatchConfig("actor/ref_kl", 0.05), WatchConfig("kl/std", 0.02), WatchConfig("critic/vf_loss", 0.5)]


@dataclass
class GuardsConfig(Freezable):
    """Stability guards (`train/guards.py`); each one that fires is logged and written to TensorBoard."""

    max_consecutive_skips: int = ranged(
        5, NON_NEGATIVE, "optimizer steps skipped for non-finite gradients in a row before the run stops (exit 3)"
    )
    grad_norm_threshold: float | None = ranged(
        None, POSITIVE, "a role's grad norm (before clipping) above this → its lr × lr_backoff_factor; null: off"
    )
    grad_norm_spike_factor: float = ranged(
        10.0, SPIKE_FACTOR, "grad norm above this × its running median → lr × lr_backoff_factor"
    )
    grad_norm_window: int = ranged(20, AT_LEAST_ONE, "iterations in the running medians")
    lr_backoff_factor: float = ranged(0.5, FACTOR, "the grad-norm guards' learning-rate factor")
    min_lr_fraction: float = ranged(0.05, FACTOR, "back-offs never take a role's lr below this × its configured lr")
    kl_explosion_threshold: float = ranged(
        1.0, POSITIVE, "the update's KL(actor‖ref) per token (nats) above which the run rolls back"
    )
    loss_explosion_factor: float | None = ranged(
        None, SPIKE_FACTOR, "|loss| above this × its running median, or a non-finite loss → rollback; null: off"
    )
    loss_explosion_floor: float = ranged(
        1.0,
        NON_NEGATIVE,
        "|loss| at or below this is no explosion whatever its median: a policy loss of whitened advantages sits "
        "near zero (±0.01–0.1), where loss_explosion_factor × its median is noise",
    )
    rollback_lr_factor: float = ranged(0.5, FACTOR, "every learning rate × this after a rollback")
    max_rollbacks: int = ranged(3, NON_NEGATIVE, "rollbacks allowed per run; one more asked for stops the run")
    kl_bump_threshold: float | None = ranged(
        None, POSITIVE, "the update's KL per token above this → every active β × kl_bump_factor; null: off"
    )
    kl_bump_factor: float = ranged(1.2, SPIKE_FACTOR, "the KL bump's factor")
    eval_drop_fraction: float | None = ranged(
        None,
        FACTOR,
        "eval/reward_mean below best − fraction·|best| → roll back to the best evaluation's checkpoint; null: off",
    )
    plateau_evaluations: int = ranged(
        0, NON_NEGATIVE, "no new best evaluation in this many → every lr × plateau_lr_factor; 0: off"
    )
    plateau_lr_factor: float = ranged(0.9, FACTOR, "the plateau back-off's factor")
    max_oom_retries: int = ranged(3, NON_NEGATIVE, "out-of-memory retries with a smaller micro-batch, per run")
    oom_agreement_timeout_s: float = ranged(
        600.0,
        POSITIVE,
        "how long a rank that ran out of memory waits for the others to agree on a retry; past it the run stops, "
        "leaving its checkpoint",
    )
    watch: list[WatchConfig] = described(
        default_factory=_default_watch, doc="watched metrics: each a metric, a max and an action"
    )


@dataclass
class TrainerConfig(Freezable):
    """Loop length, logging, checkpoints (verl `trainer.*`)."""

    project_name: str = described(
        "megatron-ppo", "with experiment_name, names the run in the logs, W&B and the Slurm job"
    )
    experiment_name: str = described("run", "the run's name in the logs (W&B run name)")
    total_epochs: int = per_job(
        ranged(1, AT_LEAST_ONE, "passes over the data when total_training_steps is null"), RUN_LENGTH
    )
    total_training_steps: int | None = per_job(
        ranged(None, AT_LEAST_ONE, "the run's length in iterations; null: from the data and total_epochs"), RUN_LENGTH
    )
    critic_warmup: int = ranged(0, NON_NEGATIVE, "iterations that train the critic only")
    save_freq: int = per_job(
        ranged(
            0,
            SAVE_FREQ,
            "checkpoint every save_freq steps and at the end; 0: only at the end; -1: never (but preemption and "
            "job-budget saves)",
        ),
        RUN_CONTROL,
    )
    test_freq: int = per_job(ranged(0, NON_NEGATIVE, "evaluate every test_freq steps; 0: never"), RUN_CONTROL)
    val_before_train: bool = per_job(
        True, RUN_CONTROL, "evaluate at step 0 (verl's default), when there is something to evaluate on"
    )
    default_local_dir: str = per_job(
        "outputs/checkpoints", RUN_CONTROL, "the run's checkpoint directory (one run per directory)"
    )
    log_dir: str = per_job("outputs/tensorboard", RUN_CONTROL, "TensorBoard root: events go to <log_dir>/<run id>/")
    logger: list[str] = described(
        default_factory=lambda: ["console", "tensorboard"],
        doc="where metrics go: console, tensorboard, wandb (the wandb extra), mlflow (the mlflow extra; the server "
        "from MLFLOW_TRACKING_URI)",
        **each_of(("console", "tensorboard", "wandb", "mlflow"), **{PER_JOB: RUN_CONTROL}),
    )
    resume_mode: str = per_job(
        choice(
            "auto",
            ("auto", "disable", "resume_path"),
            "auto: continue the run `latest` names; resume_path: the run that saved resume_from_path; disable: a new "
            "run",
        ),
        RUN_CONTROL,
    )
    resume_from_path: str | None = per_job(None, RUN_CONTROL, "the checkpoint resume_mode=resume_path continues from")
    overwrite: bool = per_job(
        False,
        RUN_CONTROL,
        "move another run's checkpoints (and `latest`) into default_local_dir/moved-aside/<UTC time>-<hex>/ instead "
        "of refusing to start",
    )
    max_ckpt_to_keep: int | None = per_job(
        ranged(2, NON_NEGATIVE, "this run's complete checkpoints kept (never the one `latest` names); null: all"),
        RUN_CONTROL,
    )
    async_save: bool = per_job(
        True,
        RUN_CONTROL,
        "write checkpoints in the background (Megatron's asynchronous save), published once every rank's write is "
        "done; false: wait for the disk",
    )
    exit_interval: int | None = per_job(
        ranged(
            None,
            OFF_OR_POSITIVE,
            "this job stops cleanly (checkpoint, exit 0) after a step divisible by this; null: off",
        ),
        RUN_CONTROL,
    )
    exit_duration_in_mins: float | None = per_job(
        ranged(None, OFF_OR_POSITIVE, "this job stops cleanly (checkpoint, exit 0) after this many minutes; null: off"),
        RUN_CONTROL,
    )
    seed: int = described(1, "seed of initial weights, dropout and sampling")


@dataclass
class ClusterConfig(Freezable):
    """Where the job runs; nodes × gpus_per_node is the world size every role's layout must fill."""

    nodes: int = ranged(1, AT_LEAST_ONE, "nodes of the job (nodes × gpus_per_node is the world every layout must fill)")
    gpus_per_node: int = ranged(1, AT_LEAST_ONE, "GPUs per node (processes per node on CPU)")
    device: str = choice("cuda", ("cuda", "cpu"), "cuda (NCCL, models on the GPUs) or cpu (gloo)")
    gpu_type: str = choice(
        "h100-80gb", tuple(GPU_SPECS), "the GPU's row in config/gpus.py: its peak, memory and assumed MFU"
    )
    gpu_memory_gib: float | None = ranged(None, POSITIVE, "plan for this much GPU memory; null: the GPU type's")
    partition: str | None = described(None, "Slurm partition")
    account: str | None = described(None, "Slurm account")
    time_limit: str = described("04:00:00", "Slurm time limit (HH:MM:SS)")


@dataclass
class ProfilingConfig(Freezable):
    """Step-range profiling (`train/profiling.py`), with Megatron-Bridge's `ProfilingConfig` key names: the
    iterations profile_step_start ≤ n < profile_step_end on the ranks profile_ranks."""

    use_pytorch_profiler: bool = per_job(
        False, RUN_CONTROL, "a torch-profiler trace per profiled rank in <log dir>/<run id>/profile/"
    )
    use_nsys_profiler: bool = per_job(
        False, RUN_CONTROL, "cudaProfilerStart/Stop around the range, for nsys profile --capture-range=cudaProfilerApi"
    )
    profile_step_start: int = per_job(ranged(10, AT_LEAST_ONE, "the first profiled iteration"), RUN_CONTROL)
    profile_step_end: int = per_job(ranged(12, AT_LEAST_ONE, "the first iteration not profiled"), RUN_CONTROL)
    profile_ranks: list[int] = described(
        default_factory=lambda: [0], doc="the ranks that profile", **{PER_JOB: RUN_CONTROL}
    )
    record_shapes: bool = per_job(False, RUN_CONTROL, "the torch trace records each operator's input shapes")
    record_memory_history: bool = per_job(
        False,
        RUN_CONTROL,
        "CUDA allocator history from profile_step_start, dumped at the range's end or the first out-of-memory error",
    )
    memory_snapshot_path: str = per_job(
        "snapshot.pickle", RUN_CONTROL, "the memory snapshot's file (relative: in <log dir>/<run id>/profile/)"
    )
    nvtx_ranges: bool = per_job(False, RUN_CONTROL, "the phases as NVTX ranges (for nsys), on CUDA")


@dataclass
class PPOConfig(Freezable):
    """The whole config. `defaults:` in a YAML file is consumed by composition and is not part of it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)

    # What the run builds, derived once here (trainer, out-of-memory back-off and validation ask these):
    @property
    def needs_reference(self) -> bool:
        """A KL term is on (`actor.use_kl_loss`, `algorithm.use_kl_in_reward`): the frozen reference is built."""
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward

    @property
    def needs_critic(self) -> bool:
        """GAE needs values (`algorithm.adv_estimator=gae`): the critic is built and trained; GRPO and the other
        estimators train none."""
        return self.algorithm.adv_estimator == "gae"
