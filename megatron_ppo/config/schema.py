"""The typed shape of a megatron-ppo config: one dataclass per group, verl's leaf names where verl has them.

Top level: model, data, actor, ref, critic, algorithm, reward, guards, trainer, cluster. Each role (actor, ref,
critic) has a `megatron` section (its parallel layout); the trained roles also have an `optim` section — the
shape of verl's Megatron config, so `actor_rollout_ref.actor.*` paths map onto `actor.*`.
Values are checked for range and consistency in `validate.py`; this file only says what exists and its type.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ModelConfig:
    """GPT architecture shared by actor, critic trunk and reference (Megatron `TransformerConfig` names)."""

    name: str = "tiny"
    num_layers: int = 2
    hidden_size: int = 128
    ffn_hidden_size: int | None = None  # None: 4 × hidden (gelu) or Megatron's SwiGLU default
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (= num_attention_heads)
    kv_channels: int | None = None  # None: hidden_size / num_attention_heads
    vocab_size: int = 256
    max_position_embeddings: int = 512
    position_embedding_type: str = "rope"  # rope | learned_absolute
    rotary_base: float = 10000.0
    rope_scaling_factor: float | None = None  # Llama 3.1 RoPE scaling (rope_type llama3; Llama 3.1: 8); None: off
    normalization: str = "RMSNorm"  # RMSNorm | LayerNorm
    layernorm_epsilon: float = 1.0e-6
    activation: str = "swiglu"  # swiglu | gelu
    add_qkv_bias: bool = False  # Qwen2
    qk_layernorm: bool = False  # normalization of each query and key head before RoPE (Qwen3)
    add_bias_linear: bool = False  # biases on the other linear layers (GPT-2 style); Llama/Qwen have none
    untie_embeddings_and_output_weights: bool = True
    params_dtype: str = "bf16"  # bf16 | fp16 | fp32
    init_method_std: float = 0.02
    make_vocab_size_divisible_by: int = 128  # lcm with TP; padded logits are masked out of every log-prob
    transformer_impl: str = "auto"  # auto (Transformer Engine on CUDA when installed) | local | transformer_engine
    hf_checkpoint: str | None = None  # Hugging Face directory to convert from on first use
    init_checkpoint: str | None = None  # megatron-ppo checkpoint whose "actor" initialises actor, ref, critic trunk
    tokenizer: str | None = None  # sentencepiece .model or HF tokenizer.json / directory


@dataclass
class MegatronConfig:
    """Parallel layout of one role (verl: `actor_rollout_ref.actor.megatron.*`)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size: int = 1
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: str | None = None  # None | full | selective
    recompute_method: str | None = None  # uniform | block (with full recompute)
    recompute_num_layers: int | None = None
    param_offload: bool = False
    optimizer_offload: bool = False


@dataclass
class OptimConfig:
    """Optimizer and learning-rate schedule of one trained role (verl: `actor_rollout_ref.actor.optim.*`)."""

    optimizer: str = "adam"
    lr: float = 1.0e-6
    min_lr: float = 0.0
    lr_warmup_steps: int | None = None  # wins over the ratio when set
    lr_warmup_steps_ratio: float = 0.0
    lr_decay_style: str = "constant"  # constant | linear | cosine
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0


@dataclass
class AdditionTaskConfig:
    """The embedded demo task (data.task=addition): prompts, SFT of the initial policy, the sampled dataset."""

    num_prompts: int = 2000
    num_heldout: int = 200
    samples_per_prompt: int = 4
    sample_temperature: float = 1.0
    sft_steps: int = 1000
    sft_batch_size: int = 128
    sft_lr: float = 2.0e-3
    work_dir: str = "outputs/tiny"


@dataclass
class DataConfig:
    """Offline dataset: rows of (prompt, response, reward) and how they are batched."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    format: str = "auto"  # auto (by extension) | jsonl | parquet
    prompt_key: str = "prompt"
    response_key: str = "response"
    reward_key: str = "reward"
    max_prompt_length: int = 64
    max_response_length: int = 64
    overlong_policy: str = "filter"  # filter | truncate (counted and reported either way)
    on_bad_row: str = "error"  # error | skip (rejected rows go to a rejects file, with their reason)
    train_batch_size: int = 512
    shuffle: bool = True
    seed: int = 1
    task: str | None = None  # "addition": build the tiny recipe's data (tokenizer, SFT policy, sampled rows) first
    addition: AdditionTaskConfig = field(default_factory=AdditionTaskConfig)


@dataclass
class ActorConfig:
    """The trained policy: PPO objective (verl `actor_rollout_ref.actor.*` leaves), layout and optimizer."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = 128
    ppo_micro_batch_size_per_gpu: int | None = 16
    log_prob_micro_batch_size_per_gpu: int | None = None  # None: ppo_micro_batch_size_per_gpu
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None: clip_ratio (verl defaults these to 0.2, hiding clip_ratio)
    clip_ratio_high: float | None = None  # None: clip_ratio
    clip_ratio_c: float = 3.0
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    loss_agg_mode: str = "token-mean"
    behavior_is_cap: float | None = None  # truncated importance weights against behaviour log-probs, if set
    behavior_is_level: str = "token"  # token | sequence


@dataclass
class RefConfig:
    """The frozen reference policy: only a layout."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    log_prob_micro_batch_size_per_gpu: int | None = None


@dataclass
class CriticConfig:
    """The value model (a GPT trunk with a scalar head)."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1.0e-5))
    ppo_mini_batch_size: int = 128
    ppo_micro_batch_size_per_gpu: int | None = 16
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    ppo_epochs: int = 1
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"


@dataclass
class KLStageConfig:
    """One phase of a staged KL schedule; `end` in `kl_ctrl.stage_unit` (fraction of the run, or step)."""

    name: str = "stage"
    end: float = 1.0
    controller: str = "power_law"  # warmup | fixed | adaptive | power_law | band
    target_kl: float | None = None
    band: list[float] | None = None  # [low, high] for the band rule; default [target/1.5, target·1.5]
    horizon: float = 10000.0
    alpha: float = 1.5
    guards: dict[str, float] = field(default_factory=dict)  # overrides of `guards.*` thresholds in this stage


@dataclass
class KLControlConfig:
    """How β moves (verl `algorithm.kl_ctrl`). It drives the coefficients listed in `apply_to` that are enabled:
    `loss` starts from `actor.kl_loss_coef`, `reward` from `kl_coef`; a term not listed keeps its coefficient."""

    type: str = "fixed"  # fixed | adaptive | power_law | band | staged
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: float = 10000.0
    alpha: float = 1.5
    band: list[float] | None = None
    min_coef: float = 1.0e-6
    max_coef: float = 1.0
    apply_to: list[str] = field(default_factory=lambda: ["loss", "reward"])
    stage_unit: str = "fraction"  # fraction | step
    stages: list[KLStageConfig] = field(default_factory=list)


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL in the reward (verl `algorithm.*`)."""

    adv_estimator: str = "gae"  # gae | grpo
    gamma: float = 1.0
    lam: float = 0.95
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass
class RewardConfig:
    """Sequence-reward shaping before it is placed on the last response token."""

    clip_range: list[float] | None = None  # [low, high]
    normalize: bool = False  # running mean/std over all rewards seen


@dataclass
class GuardsConfig:
    """Stability guards; each one that fires is logged and written to TensorBoard."""

    skip_nonfinite: bool = True
    max_consecutive_skips: int = 5
    grad_norm_spike_factor: float = 10.0  # spike: grad norm > factor × running median of the window
    grad_norm_window: int = 20
    lr_backoff_factor: float = 0.5
    kl_explosion_threshold: float = 1.0  # per-token KL(actor‖ref) in nats that triggers a rollback
    rollback_lr_factor: float = 0.5
    max_rollbacks: int = 3


@dataclass
class TrainerConfig:
    """Loop length, logging, checkpoints (verl `trainer.*`)."""

    project_name: str = "megatron-ppo"
    experiment_name: str = "run"
    total_epochs: int = 1
    total_training_steps: int | None = None  # None: derived from the data and total_epochs
    critic_warmup: int = 0
    save_freq: int = 0  # 0: only at the end
    test_freq: int = 0
    default_local_dir: str = "outputs/checkpoints"
    log_dir: str = "outputs/tensorboard"
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    resume_mode: str = "auto"  # auto | disable | resume_path
    resume_from_path: str | None = None
    max_ckpt_to_keep: int | None = 2
    # One job of a chain stops cleanly (checkpoint, exit 0) for the next job to resume: after a step divisible by
    # exit_interval, or after exit_duration_in_mins of this job (Megatron-LM's --exit-interval/--exit-duration-in-mins).
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    seed: int = 1


@dataclass
class ClusterConfig:
    """Where the job runs; nodes × gpus_per_node is the world size every role's layout must fill."""

    nodes: int = 1
    gpus_per_node: int = 1  # processes per node on CPU
    device: str = "cuda"  # cuda | cpu
    gpu_type: str = "h100-80gb"
    gpu_memory_gib: float = 80.0
    partition: str | None = None
    account: str | None = None
    time_limit: str = "04:00:00"


@dataclass
class PPOConfig:
    """The whole config. `defaults:` in a YAML file is consumed by composition and is not part of it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    guards: GuardsConfig = field(default_factory=GuardsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


ROLES = ("actor", "ref", "critic")
