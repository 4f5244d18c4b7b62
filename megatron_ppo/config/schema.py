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
# where it writes and when it stops; the run's length (the KL and learning-rate schedules refuse, on load, a change
# they cannot follow, with their own message); how the work is cut into micro-batches (the same training).
RUN_CONTROL = "run control"
RUN_LENGTH = "the run's length"
MICRO_BATCHING = "micro-batching"


@dataclass
class ModelConfig(Freezable):
    """GPT architecture shared by actor, critic trunk and reference (Megatron `TransformerConfig` names)."""

    name: str = "tiny"
    num_layers: int = ranged(2, AT_LEAST_ONE)
    hidden_size: int = ranged(128, AT_LEAST_ONE)
    ffn_hidden_size: int | None = ranged(None, AT_LEAST_ONE)  # None: 4 × hidden (gelu) or Megatron's SwiGLU default
    num_attention_heads: int = ranged(4, AT_LEAST_ONE)
    num_query_groups: int | None = ranged(None, AT_LEAST_ONE)  # None: multi-head attention (= num_attention_heads)
    kv_channels: int | None = ranged(None, AT_LEAST_ONE)  # None: hidden_size / num_attention_heads
    vocab_size: int = ranged(256, AT_LEAST_ONE)
    max_position_embeddings: int = ranged(512, AT_LEAST_ONE)
    position_embedding_type: str = choice("rope", ("rope", "learned_absolute"))
    rotary_base: float = 10000.0
    # Llama 3.1 RoPE scaling (rope_type llama3; Llama 3.1: 8); None: off
    rope_scaling_factor: float | None = ranged(None, ROPE_FACTOR)
    normalization: str = choice("RMSNorm", ("RMSNorm", "LayerNorm"))
    layernorm_epsilon: float = 1.0e-6
    activation: str = choice("swiglu", ("swiglu", "gelu"))
    add_qkv_bias: bool = False  # Qwen2
    qk_layernorm: bool = False  # normalization of each query and key head before RoPE (Qwen3)
    add_bias_linear: bool = False  # biases on the other linear layers (GPT-2 style); Llama/Qwen have none
    untie_embeddings_and_output_weights: bool = True
    params_dtype: str = choice("bf16", ("bf16", "fp16", "fp32"))
    init_method_std: float = 0.02
    # lcm with TP; padded logits are masked out of every log-prob
    make_vocab_size_divisible_by: int = ranged(128, AT_LEAST_ONE)
    transformer_impl: str = choice("auto", ("auto", "local", "transformer_engine"))
    # CUDA: draw full weights on the host, then split them: the same initial weights for every TP layout, but slow
    # for large models (weights are drawn on the GPU, per shard, otherwise). The CPU path always does this.
    use_cpu_initialization: bool = False
    # Log-probs and entropy over [tokens, vocab / TP] run in chunks of this many tokens, in fp32 per chunk and
    # recomputed in the backward: the memory above the logits is one chunk's fp32 (null: all tokens at once).
    logprob_chunk_tokens: int | None = ranged(2048, AT_LEAST_ONE)
    # Packed sequences (THD; verl's use_remove_padding) in every pass of actor, reference and critic: a micro-batch
    # enters the model as one [1, T] row of whole sequences, each padded only to the layout's multiple (TP with
    # sequence parallelism), attention causal inside each sequence (megatron_ppo.models.packing); token budgets
    # (use_dynamic_bsz) then count packed tokens. Not with context parallelism (yet).
    pack_sequences: bool = False
    hf_checkpoint: str | None = None  # Hugging Face directory to convert from on first use
    init_checkpoint: str | None = None  # megatron-ppo checkpoint whose "actor" initialises actor, ref, critic trunk
    allow_random_init: bool = False  # a dataset run without initial weights (smoke tests, benchmarks only)
    tokenizer: str | None = None  # sentencepiece .model or HF tokenizer.json / directory
    # Mixture of experts (Hugging Face Qwen3-MoE names): every layer's MLP becomes `num_experts` expert MLPs of
    # `moe_intermediate_size`, each token routed to its top `num_experts_per_tok` by a softmax router, dropless.
    num_experts: int = ranged(0, NON_NEGATIVE)  # 0: dense
    num_experts_per_tok: int = ranged(0, NON_NEGATIVE)  # top-k
    moe_intermediate_size: int = ranged(0, NON_NEGATIVE)  # each expert's FFN width
    norm_topk_prob: bool = True  # renormalise the top-k routing probabilities to sum to 1 (Qwen3-MoE: true)
    # the router's load-balancing loss (Switch Transformer's) times this, added to the actor's loss
    router_aux_loss_coef: float = ranged(0.0, COEFFICIENT)
    # how tokens reach the experts of other expert-parallel ranks: allgather (CPU and GPU), alltoall (GPU only)
    moe_token_dispatcher: str = choice("allgather", ("allgather", "alltoall"))


@dataclass
class MegatronConfig(Freezable):
    """Parallel layout of one role (verl: `actor_rollout_ref.actor.megatron.*`)."""

    tensor_model_parallel_size: int = shared_layout(ranged(1, AT_LEAST_ONE))
    pipeline_model_parallel_size: int = shared_layout(ranged(1, AT_LEAST_ONE))
    virtual_pipeline_model_parallel_size: int | None = ranged(None, AT_LEAST_ONE)
    context_parallel_size: int = shared_layout(ranged(1, AT_LEAST_ONE))
    # experts split over EP ranks (carved out of the data-parallel × context-parallel ranks)
    expert_model_parallel_size: int = shared_layout(ranged(1, AT_LEAST_ONE))
    # each expert's TP; None: the same as TP
    expert_tensor_parallel_size: int | None = shared_layout(ranged(None, AT_LEAST_ONE))
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    recompute_granularity: str | None = choice(None, (None, "full", "selective"))
    recompute_method: str | None = choice(None, (None, "uniform", "block"))
    recompute_num_layers: int | None = ranged(None, AT_LEAST_ONE)
    # this role's micro-batch widths (tokens per row) rounded up to a multiple of this (lcm with the layout's own
    # multiple), so attention and compiled kernels see few shapes; the padding stays out of every loss, metric and
    # log-prob, its cost is perf/padded_over_real_tokens. null: 128 on CUDA, 1 on CPU (models.widths.width_bucket)
    make_sequence_length_divisible_by: int | None = ranged(None, AT_LEAST_ONE)
    # Host offload between phases (verl's switches; megatron_ppo.models.offload): outside the phases that need
    # them, the role's weights / gradients / optimizer states wait in (pinned) host memory.
    param_offload: bool = False
    optimizer_offload: bool = False
    grad_offload: bool = False


@dataclass
class OptimConfig(Freezable):
    """Optimizer and learning-rate schedule of one trained role (verl: `actor_rollout_ref.actor.optim.*`)."""

    optimizer: str = choice("adam", ("adam", "sgd"))
    lr: float = ranged(1.0e-6, POSITIVE)
    min_lr: float = ranged(0.0, NON_NEGATIVE)
    lr_warmup_steps: int | None = ranged(None, NON_NEGATIVE)  # wins over the ratio when set
    lr_warmup_steps_ratio: float = ranged(0.0, UNIT_INTERVAL)
    lr_decay_style: str = choice("constant", ("constant", "linear", "cosine"))
    weight_decay: float = ranged(0.01, NON_NEGATIVE)
    adam_beta1: float = ranged(0.9, BETA)
    adam_beta2: float = ranged(0.999, BETA)
    adam_eps: float = 1.0e-8
    clip_grad: float = ranged(1.0, CLIP_GRAD)


@dataclass
class AdditionTaskConfig(Freezable):
    """The embedded demo task (data.task=addition): prompts, SFT of the initial policy, the sampled dataset."""

    num_prompts: int = 2000
    num_heldout: int = 200
    samples_per_prompt: int = 4
    sample_temperature: float = 1.0
    sft_steps: int = 1000
    sft_batch_size: int = 128
    sft_lr: float = 2.0e-3
    work_dir: str = "outputs/tiny"  # the task cache: one task-<hash> folder per task setting (recipe.task_directory)


@dataclass
class DataConfig(Freezable):
    """Offline dataset: rows of (prompt, response, reward) and how they are batched."""

    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    format: str = choice("auto", ("auto", "jsonl", "parquet"))
    prompt_key: str = "prompt"
    response_key: str = "response"
    reward_key: str = "reward"
    max_prompt_length: int = ranged(64, AT_LEAST_ONE)
    max_response_length: int = ranged(64, AT_LEAST_ONE)
    # A row whose prompt or response (eos included) is over its limit: dropped and counted (filter), cut (truncate:
    # the prompt as prompt_truncation says, the response at its end) or an error naming the row (error).
    overlong_policy: str = choice("filter", ("filter", "truncate", "error"))
    # Which prompt tokens truncation keeps (verl's data.truncation): the last (left is cut), the first (right is
    # cut), or the first and last halves (middle is cut).
    prompt_truncation: str = choice("left", ("left", "right", "middle"))
    # skip: rejected rows go to a rejects file, with their reason
    on_bad_row: str = choice("error", ("error", "skip"))
    # Text rows: tokenizing prompt and response apart vs together (verl's tokenization_sanity_check_mode):
    # strict rejects a row where they differ, warn counts it in the data report, off skips the check.
    tokenization_check: str = choice("warn", ("strict", "warn", "off"))
    # Preference pairs (`data/pairs.py`): a row with a chosen_key and a rejected_key response (text, beside
    # prompt_key) becomes two rows sharing one group id (the row's uid, else its file and line). Their rewards:
    # "model" — from a reward model: `megatron-ppo score` (reward_model.*) writes them, and training refuses unscored
    # pairs; "given" — the chosen_score_key / rejected_score_key columns (UltraFeedback's); "preference" — the pair
    # itself, +1 chosen and −1 rejected (a choice to state: it knows no margin).
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    chosen_score_key: str = "chosen_score"
    rejected_score_key: str = "rejected_score"
    pair_reward: str = choice("model", ("model", "given", "preference"))
    train_batch_size: int = ranged(512, AT_LEAST_ONE)
    shuffle: bool = True
    seed: int = 1
    # "addition": build the tiny recipe's data (tokenizer, SFT policy, sampled rows) first
    task: str | None = choice(None, (None, "addition"))
    addition: AdditionTaskConfig = field(default_factory=AdditionTaskConfig)

    @property
    def max_length(self) -> int:
        """The longest row in tokens: max_prompt_length + max_response_length."""
        return self.max_prompt_length + self.max_response_length


@dataclass
class PolicyLossSettings(Freezable):
    """Which policy loss the actor trains with, and the settings of those that have their own (verl
    `actor_rollout_ref.actor.policy_loss.*`; `megatron_ppo.algo.policy_loss` gives each loss's equation)."""

    loss_mode: str = choice("vanilla", tuple(POLICY_LOSSES))
    clip_cov_ratio: float = ranged(0.0002, POSITIVE)  # clip_cov: share of tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: covariance band the cut tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = ranged(0.0002, POSITIVE)  # kl_cov: share of tokens with the |log ρ| penalty
    ppo_kl_coef: float = ranged(0.1, COEFFICIENT)  # kl_cov: that penalty's coefficient
    dro_beta: float | None = ranged(None, POSITIVE)  # dro: quadratic log-ratio penalty (required for dro)


ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")


@dataclass
class RouterReplaySettings(Freezable):
    """MoE routing replay (verl `actor_rollout_ref.actor.router_replay.*`; `models.router_replay`): the update's
    forwards send each token to the experts it went to in an earlier pass, so π_θ/π_old compares one network.
    R2: the experts of the old-log-prob pass; R3: the behaviour policy's, from the rows' `routed_experts`."""

    mode: str = choice("disabled", ROUTER_REPLAY_MODES)


@dataclass
class ActorConfig(Freezable):
    """The trained policy: PPO objective (verl `actor_rollout_ref.actor.*` leaves), layout and optimizer."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_mini_batch_size: int = ranged(128, AT_LEAST_ONE)
    ppo_micro_batch_size_per_gpu: int | None = per_job(ranged(16, AT_LEAST_ONE), MICRO_BATCHING)
    # None: ppo_micro_batch_size_per_gpu
    log_prob_micro_batch_size_per_gpu: int | None = per_job(ranged(None, AT_LEAST_ONE), MICRO_BATCHING)
    use_dynamic_bsz: bool = per_job(False, MICRO_BATCHING)
    ppo_max_token_len_per_gpu: int = per_job(ranged(16384, AT_LEAST_ONE), MICRO_BATCHING)
    ppo_epochs: int = ranged(1, AT_LEAST_ONE)
    clip_ratio: float = ranged(0.2, POSITIVE)
    # None: clip_ratio (verl defaults these to 0.2, hiding clip_ratio)
    clip_ratio_low: float | None = ranged(None, CLIP_LOW)
    clip_ratio_high: float | None = ranged(None, POSITIVE)  # None: clip_ratio
    clip_ratio_c: float = ranged(3.0, DUAL_CLIP)
    policy_loss: PolicyLossSettings = field(default_factory=PolicyLossSettings)
    tau_pos: float = ranged(1.0, POSITIVE)  # sapo: gate temperature where A > 0
    tau_neg: float = ranged(1.05, POSITIVE)  # sapo: gate temperature where A ≤ 0
    use_kl_loss: bool = True
    kl_loss_coef: float = ranged(0.001, COEFFICIENT)
    kl_loss_type: str = choice("low_var_kl", KL_PENALTY_CHOICES)
    entropy_coeff: float = ranged(0.0, COEFFICIENT)
    loss_agg_mode: str = choice("token-mean", tuple(LOSS_AGGREGATIONS))
    # seq-mean-token-sum-norm divisor; None: data.max_response_length
    loss_scale_factor: int | None = ranged(None, AT_LEAST_ONE)
    router_replay: RouterReplaySettings = field(default_factory=RouterReplaySettings)  # MoE only


@dataclass
class RefConfig(Freezable):
    """The frozen reference policy: only a layout."""

    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    # None: actor.log_prob_micro_batch_size_per_gpu
    log_prob_micro_batch_size_per_gpu: int | None = per_job(ranged(None, AT_LEAST_ONE), MICRO_BATCHING)


@dataclass
class CriticModelConfig(Freezable):
    """The critic's own initial weights (verl: `critic.model.path`); unset: the actor's trunk and a zero head.
    A reward model is a common start: the value head takes a sequence-classification model's one-label `score`."""

    hf_checkpoint: str | None = None  # Hugging Face directory to convert on first use (verl's critic.model.path)
    init_checkpoint: str | None = None  # megatron-ppo checkpoint: its "critic" if it saved one, else its "actor" trunk


@dataclass
class CriticConfig(Freezable):
    """The value model (a GPT trunk with a scalar head)."""

    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1.0e-5))
    ppo_mini_batch_size: int = ranged(128, AT_LEAST_ONE)
    ppo_micro_batch_size_per_gpu: int | None = per_job(ranged(16, AT_LEAST_ONE), MICRO_BATCHING)
    # values in the experience pass; None: ppo_micro_...
    forward_micro_batch_size_per_gpu: int | None = per_job(ranged(None, AT_LEAST_ONE), MICRO_BATCHING)
    use_dynamic_bsz: bool = per_job(False, MICRO_BATCHING)
    ppo_max_token_len_per_gpu: int = per_job(ranged(16384, AT_LEAST_ONE), MICRO_BATCHING)
    ppo_epochs: int = ranged(1, AT_LEAST_ONE)
    cliprange_value: float = ranged(0.5, POSITIVE)
    loss_agg_mode: str = choice("token-mean", tuple(LOSS_AGGREGATIONS))
    # seq-mean-token-sum-norm divisor; None: actor.loss_scale_factor
    loss_scale_factor: int | None = ranged(None, AT_LEAST_ONE)


# the PI rule's most change of β in one step, as a factor (β within [β/r, β·r] per step)
RATE_LIMIT = Range(lambda v: v > 1, "> 1 (β's largest change in one step, as a factor)")
KL_FEEDBACK = ("experience", "update")  # the KL the controllers read: `kl/mean` or the update's `actor/ref_kl`


@dataclass
class KLStageConfig(Freezable):
    """One phase of a staged KL schedule; `end` in `kl_ctrl.stage_unit` (fraction of the run, or step)."""

    name: str = "stage"
    end: float = 1.0
    controller: str = choice("power_law", (WARMUP, *KL_CONTROLLERS))
    target_kl: float | None = None
    band: list[float] | None = None  # [low, high] for the band rule; default [target/1.5, target·1.5]
    horizon: float = 10000.0
    alpha: float = 1.5
    kp: float = 1.0  # pi: proportional gain, Δlog β per unit change of log KL
    ki: float = 0.5  # pi: integral gain, Δlog β per unit of log(KL/target)
    rate_limit: float = 2.0  # pi: β's largest change in one step, as a factor
    guards: dict[str, float] = field(default_factory=dict)  # overrides of `guards.*` thresholds in this stage


@dataclass
class KLControlConfig(Freezable):
    """How β moves (verl `algorithm.kl_ctrl`). It drives the coefficients listed in `apply_to` that are enabled:
    `loss` starts from `actor.kl_loss_coef`, `reward` from `kl_coef`; a term not listed keeps its coefficient."""

    type: str = choice("fixed", (*KL_CONTROLLERS, "staged"))
    kl_coef: float = ranged(0.001, COEFFICIENT)
    target_kl: float = ranged(0.1, POSITIVE)
    horizon: float = ranged(10000.0, POSITIVE)
    alpha: float = ranged(1.5, POSITIVE)
    band: list[float] | None = None
    kp: float = ranged(1.0, COEFFICIENT)  # pi: proportional gain, Δlog β per unit change of log KL
    ki: float = ranged(0.5, POSITIVE)  # pi: integral gain, Δlog β per unit of log(KL/target)
    rate_limit: float = ranged(2.0, RATE_LIMIT)  # pi: β's largest change in one step, as a factor
    # the KL every controller reads: "experience" (`kl/mean`, the policy before this iteration's update, verl's
    # input) or "update" (`actor/ref_kl`, the update's own KL: one iteration fresher)
    feedback: str = choice("experience", KL_FEEDBACK)
    min_coef: float = ranged(1.0e-6, COEFFICIENT)
    max_coef: float = 1.0
    apply_to: list[str] = field(default_factory=lambda: ["loss", "reward"])
    stage_unit: str = choice("fraction", ("fraction", "step"))
    stages: list[KLStageConfig] = field(default_factory=list)


@dataclass
class RolloutCorrectionConfig(Freezable):
    """Off-policy correction against the behaviour policy whose log-probs the rows carry (verl
    `algorithm.rollout_correction.*`; `megatron_ppo.algo.rollout_correction`). Rows with behaviour log-probs always
    log the `rollout_corr/*` diagnostics; weights and rejection apply only when set here."""

    rollout_is: str | None = choice(None, (None, *ROLLOUT_IS_LEVELS))  # importance weights per token or sequence
    # a number: truncate the weights there (TIS); "lower_upper": zero them outside the band (IcePop)
    rollout_is_threshold: str = "2.0"
    rollout_is_batch_normalize: bool = False  # divide the weights by their batch mean
    # rejection: comma-separated token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2..3 (all must pass)
    rollout_rs: str | None = None
    rollout_rs_threshold: str | None = None  # one for all options or one per option; "lower_upper" for *_k1
    # the run's start reports the off-policy diagnostics of its first batch, as a warning when the effective sample
    # size of the token weights (rollout_corr/rollout_is_eff_sample_size), or the share of tokens whose ratio lies
    # inside [1/threshold, threshold], is below this
    min_eff_sample_size: float = ranged(0.5, UNIT_INTERVAL)


@dataclass
class AlgorithmConfig(Freezable):
    """Advantage estimation and KL in the reward (verl `algorithm.*`)."""

    # verl's rollout-only estimators are named here so that validation can say why they are refused
    adv_estimator: str = choice("gae", (*ADV_ESTIMATORS, *ROLLOUT_ONLY_ESTIMATORS))
    gamma: float = ranged(1.0, UNIT_INTERVAL)
    lam: float = ranged(0.95, UNIT_INTERVAL)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = choice("kl", KL_PENALTY_CHOICES)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)


@dataclass
class CustomRewardFnConfig(Freezable):
    """A user score function (verl's `custom_reward_function`): `name(data_source=, solution_str=, ground_truth=,
    extra_info=)` → a number, or a dict with a "score"."""

    path: str | None = None  # the .py file defining it
    name: str = "compute_score"


@dataclass
class RewardConfig(Freezable):
    """Scoring of rows that carry no reward, then sequence-reward shaping before it is placed on the last token."""

    # None: rows carry rewards; verl: default_compute_score by data_source; custom: custom_fn
    score_fn: str | None = choice(None, (None, "verl", "custom"))
    custom_fn: CustomRewardFnConfig = field(default_factory=CustomRewardFnConfig)
    clip_range: list[float] | None = None  # [low, high]
    normalize: bool = False  # running mean/std over all rewards seen


@dataclass
class RewardModelWeightsConfig(Freezable):
    """The reward model `megatron-ppo score` runs (verl: `reward_model.model.*`): one of the two, its architecture
    its own (not `model.*`)."""

    # a Hugging Face *ForSequenceClassification directory with one label (verl's reward_model.model.path):
    # converted on first use under reward_model.megatron into <trainer.default_local_dir>/hf_init_reward_model
    path: str | None = None
    # a megatron-ppo checkpoint holding a value head ("critic": a PPO run's critic, or a converted reward model)
    init_checkpoint: str | None = None
    tokenizer: str | None = None  # null: model.tokenizer (text rows are tokenized with it; token-id rows need it)


@dataclass
class RewardModelConfig(Freezable):
    """Scoring rows with a reward model before PPO (`megatron-ppo score`, `convert/reward_scoring.py`): forward-only
    under its own layout over every row of data.train_files / data.val_files; the reward is the value head at the
    row's last token, as transformers' sequence classifiers score."""

    model: RewardModelWeightsConfig = field(default_factory=RewardModelWeightsConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)  # TP/PP of the scoring job; DP = the rest
    micro_batch_size_per_gpu: int = ranged(16, AT_LEAST_ONE)  # rows per forward pass (verl's name)
    use_dynamic_bsz: bool = False  # micro-batches by a token budget instead of a row count
    forward_max_token_len_per_gpu: int = ranged(16384, AT_LEAST_ONE)  # that budget (verl's name)
    # where the scored Parquet files go, as <input stem>.scored.parquet; null: beside each input
    output_dir: str | None = None


@dataclass
class WatchConfig(Freezable):
    """A watched metric: when `metric` first rises above `max` (and again after it has come back under), the run
    logs a guard event and does `action` (warn only, back off every learning rate, or bump every KL β)."""

    metric: str = "actor/ref_kl"  # the KL of the actor update (train/guards.py, UPDATE_KL)
    max: float = 0.05
    action: str = choice("warn", ("warn", "lr_backoff", "kl_bump"))


def _default_watch() -> list[WatchConfig]:
    return [WatchConfig("actor/ref_kl", 0.05), WatchConfig("kl/std", 0.02), WatchConfig("critic/vf_loss", 0.5)]


@dataclass
class GuardsConfig(Freezable):
    """Stability guards (`train/guards.py`); each one that fires is logged and written to TensorBoard."""

    max_consecutive_skips: int = ranged(5, NON_NEGATIVE)
    # absolute: a role's grad norm (before clipping) above this → its lr × lr_backoff_factor; null: off
    grad_norm_threshold: float | None = ranged(None, POSITIVE)
    # relative spike: grad norm > factor × running median of the window → lr × lr_backoff_factor
    grad_norm_spike_factor: float = ranged(10.0, SPIKE_FACTOR)
    grad_norm_window: int = ranged(20, AT_LEAST_ONE)
    lr_backoff_factor: float = ranged(0.5, FACTOR)
    min_lr_fraction: float = ranged(0.05, FACTOR)  # back-offs never take a role's lr below this × its configured lr
    kl_explosion_threshold: float = ranged(1.0, POSITIVE)  # per-token KL(actor‖ref) in nats that triggers a rollback
    # |actor loss| > factor × its running median (same window), or a non-finite loss → rollback; null: off
    loss_explosion_factor: float | None = ranged(None, SPIKE_FACTOR)
    rollback_lr_factor: float = ranged(0.5, FACTOR)
    max_rollbacks: int = ranged(3, NON_NEGATIVE)
    kl_bump_threshold: float | None = ranged(None, POSITIVE)  # KL per token above it → every active β × kl_bump_factor
    kl_bump_factor: float = ranged(1.2, SPIKE_FACTOR)
    # eval/reward_mean below best − fraction·|best| → roll back to the best evaluation's checkpoint; null: off
    eval_drop_fraction: float | None = ranged(None, FACTOR)
    plateau_evaluations: int = ranged(0, NON_NEGATIVE)  # no new best reward in this many evaluations → lr back-off
    plateau_lr_factor: float = ranged(0.9, FACTOR)
    max_oom_retries: int = ranged(3, NON_NEGATIVE)  # out-of-memory retries with a smaller micro-batch, per run
    # how long a rank that ran out of memory waits for the others to agree on a retry (train/memory_backoff.py):
    # longer than one mini-batch's forward-backward; past it the error was one rank's alone and the run stops,
    # leaving its checkpoint (a retry would need the others out of the collective they wait in)
    oom_agreement_timeout_s: float = ranged(600.0, POSITIVE)
    watch: list[WatchConfig] = field(default_factory=_default_watch)


@dataclass
class TrainerConfig(Freezable):
    """Loop length, logging, checkpoints (verl `trainer.*`)."""

    project_name: str = "megatron-ppo"  # with experiment_name, names the run in the logs (and the Slurm job)
    experiment_name: str = "run"
    total_epochs: int = per_job(ranged(1, AT_LEAST_ONE), RUN_LENGTH)
    # None: derived from the data and total_epochs
    total_training_steps: int | None = per_job(ranged(None, AT_LEAST_ONE), RUN_LENGTH)
    critic_warmup: int = ranged(0, NON_NEGATIVE)
    # Checkpoint every save_freq steps and at the end; 0: only at the end; -1 (verl): never — except the save a
    # preempted job or one whose budget (exit_interval, exit_duration_in_mins) is spent makes for the next job.
    save_freq: int = per_job(ranged(0, SAVE_FREQ), RUN_CONTROL)
    test_freq: int = per_job(ranged(0, NON_NEGATIVE), RUN_CONTROL)
    # evaluate at step 0 (verl's default), when there is something to evaluate on
    val_before_train: bool = per_job(True, RUN_CONTROL)
    default_local_dir: str = per_job("outputs/checkpoints", RUN_CONTROL)
    log_dir: str = per_job("outputs/tensorboard", RUN_CONTROL)
    # console, tensorboard, wandb (the `wandb` extra; W&B project = project_name, run name = experiment_name)
    logger: list[str] = field(
        default_factory=lambda: ["console", "tensorboard"],
        metadata=each_of(("console", "tensorboard", "wandb"), **{PER_JOB: RUN_CONTROL}),
    )
    resume_mode: str = per_job(choice("auto", ("auto", "disable", "resume_path")), RUN_CONTROL)
    resume_from_path: str | None = per_job(None, RUN_CONTROL)
    # Where default_local_dir holds another run's checkpoints, move them (and `latest`) into
    # default_local_dir/moved-aside/<UTC time>-<hex>/ instead of refusing to start; nothing is deleted.
    overwrite: bool = per_job(False, RUN_CONTROL)
    max_ckpt_to_keep: int | None = per_job(ranged(2, NON_NEGATIVE), RUN_CONTROL)
    # Write checkpoints in the background (Megatron's asynchronous dist_checkpointing save: a forked writer per
    # rank) while training goes on; published (step_N, `latest`) once every rank's write is done. Costs host memory
    # for one copy of each rank's shards on GPUs (the fork's pages on the CPU). false: the loop waits for the disk.
    async_save: bool = per_job(True, RUN_CONTROL)
    # One job of a chain stops cleanly (checkpoint, exit 0) for the next job to resume: after a step divisible by
    # exit_interval, or after exit_duration_in_mins of this job (Megatron-LM's --exit-interval/--exit-duration-in-mins).
    exit_interval: int | None = per_job(ranged(None, OFF_OR_POSITIVE), RUN_CONTROL)
    exit_duration_in_mins: float | None = per_job(ranged(None, OFF_OR_POSITIVE), RUN_CONTROL)
    seed: int = 1


@dataclass
class ClusterConfig(Freezable):
    """Where the job runs; nodes × gpus_per_node is the world size every role's layout must fill."""

    nodes: int = ranged(1, AT_LEAST_ONE)
    gpus_per_node: int = ranged(1, AT_LEAST_ONE)  # processes per node on CPU
    device: str = choice("cuda", ("cuda", "cpu"))
    gpu_type: str = choice("h100-80gb", tuple(GPU_SPECS))  # its peak, memory and assumed MFU: config/gpus.py
    gpu_memory_gib: float | None = ranged(None, POSITIVE)  # None: the GPU type's memory; set it to plan for less
    partition: str | None = None
    account: str | None = None
    time_limit: str = "04:00:00"


@dataclass
class ProfilingConfig(Freezable):
    """Step-range profiling (`train/profiling.py`), with Megatron-Bridge's `ProfilingConfig` key names: the
    iterations profile_step_start ≤ n < profile_step_end on the ranks profile_ranks."""

    use_pytorch_profiler: bool = per_job(False, RUN_CONTROL)  # a torch-profiler trace in <log dir>/profile/
    # cudaProfilerStart/Stop around the range, for nsys profile --capture-range=cudaProfilerApi
    use_nsys_profiler: bool = per_job(False, RUN_CONTROL)
    profile_step_start: int = per_job(ranged(10, AT_LEAST_ONE), RUN_CONTROL)
    profile_step_end: int = per_job(ranged(12, AT_LEAST_ONE), RUN_CONTROL)  # the first iteration not profiled
    profile_ranks: list[int] = field(default_factory=lambda: [0], metadata={PER_JOB: RUN_CONTROL})
    record_shapes: bool = per_job(False, RUN_CONTROL)  # the torch trace records each operator's input shapes
    # CUDA allocator history from profile_step_start, dumped at the range's end or the first out-of-memory error
    record_memory_history: bool = per_job(False, RUN_CONTROL)
    memory_snapshot_path: str = per_job("snapshot.pickle", RUN_CONTROL)  # relative: in <log dir>/profile/
    nvtx_ranges: bool = per_job(False, RUN_CONTROL)  # the phases as NVTX ranges (for nsys), on CUDA


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
