"""Resolution of derived defaults, and validation of a typed config before anything heavy is built.

`validate` returns every problem as one line: the key, the value, what is wrong and what to change. Each key's
own choices and range are on its schema field (`config.fields`); the rules between keys are here, those of the
parallel layouts in `layout_rules.py` (with the arithmetic of `layout.py`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

from megatron_ppo.algo.advantages import ROLLOUT_ONLY_ESTIMATORS
from megatron_ppo.algo.kl_schedule import WARMUP
from megatron_ppo.algo.rollout_correction import parse_is_threshold, parse_rs_options, parse_rs_thresholds
from megatron_ppo.config.fields import choices_of, field_problems
from megatron_ppo.config.gpu_only import cpu_problems
from megatron_ppo.config.hf_rope import hf_rope_scaling
from megatron_ppo.config.layout import data_parallel_size, divisors, model_parallel_size, world_size
from megatron_ppo.config.layout_rules import layout_problems
from megatron_ppo.config.lora_rules import lora_problems
from megatron_ppo.config.schema import TRAINED_ROLES, GuardsConfig, KLStageConfig, PPOConfig


def resolve(config: PPOConfig) -> None:
    """Fill the defaults that depend on other keys (in place).

    `clip_ratio_low/high` default to `clip_ratio` — in verl they default to 0.2 on their own, so setting only
    `clip_ratio` there silently changes nothing. `loss_scale_factor` (the constant divisor of
    seq-mean-token-sum-norm) defaults to `data.max_response_length`, the critic's to the actor's, as in verl.
    Each role's experience forward takes its own micro-batch size, by default the actor's (ref) or its own
    update's (critic).
    """
    actor, critic = config.actor, config.critic
    actor.clip_ratio_low = actor.clip_ratio if actor.clip_ratio_low is None else actor.clip_ratio_low
    actor.clip_ratio_high = actor.clip_ratio if actor.clip_ratio_high is None else actor.clip_ratio_high
    if actor.log_prob_micro_batch_size_per_gpu is None:
        actor.log_prob_micro_batch_size_per_gpu = actor.ppo_micro_batch_size_per_gpu
    if config.ref.log_prob_micro_batch_size_per_gpu is None:
        config.ref.log_prob_micro_batch_size_per_gpu = actor.log_prob_micro_batch_size_per_gpu
    if critic.forward_micro_batch_size_per_gpu is None:
        critic.forward_micro_batch_size_per_gpu = critic.ppo_micro_batch_size_per_gpu
    if actor.loss_scale_factor is None:
        actor.loss_scale_factor = config.data.max_response_length
    if critic.loss_scale_factor is None:
        critic.loss_scale_factor = actor.loss_scale_factor
    if config.reward.custom_fn.path and config.reward.score_fn is None:  # verl: a custom_reward_function.path is used
        config.reward.score_fn = "custom"


def get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def validate(config: PPOConfig) -> list[str]:
    """Every problem in `config`, one line each (empty when it is sound)."""
    problems = field_problems(config)
    problems += _cross_key_problems(config)
    problems += cpu_problems(config)  # the settings that need CUDA (`gpu_only.GPU_ONLY`)
    problems += _model_problems(config)
    problems += layout_problems(config)  # TP/PP/VPP/CP, the shared layout, experts, offload (`layout_rules.py`)
    problems += lora_problems(config)  # actor.lora.*, critic.lora.* (`lora_rules.py`)
    problems += _batch_problems(config)
    problems += _kl_problems(config)
    problems += _reward_problems(config)
    problems += _algorithm_problems(config)
    problems += _profiling_problems(config)
    return problems


def _profiling_problems(c: PPOConfig) -> list[str]:
    """The step range, the ranks and the switches that only one profiler reads."""
    prof, p = c.profiling, []
    if prof.profile_step_end <= prof.profile_step_start:
        p.append(f"profiling.profile_step_end={prof.profile_step_end} must be > profiling.profile_step_start="
                 f"{prof.profile_step_start}: the iterations start ≤ n < end are profiled")  # fmt: skip
    ranks = world_size(c)
    outside = [rank for rank in prof.profile_ranks if not 0 <= rank < ranks]
    if outside:
        p.append(f"profiling.profile_ranks={prof.profile_ranks}: {outside} not among the run's ranks 0–{ranks - 1}")
    if prof.use_pytorch_profiler and prof.use_nsys_profiler:
        p.append("profiling.use_pytorch_profiler and profiling.use_nsys_profiler both record CUDA activity "
                 "(CUPTI) and disturb each other: switch one on at a time")  # fmt: skip
    if prof.record_shapes and not prof.use_pytorch_profiler:
        p.append("profiling.record_shapes is read by the torch profiler: set profiling.use_pytorch_profiler=true")
    return p


def _algorithm_problems(c: PPOConfig) -> list[str]:
    """verl's estimators that need a rollout, the settings a chosen policy loss requires, and the off-policy
    correction's threshold strings (parsed as the correction parses them)."""
    p = []
    estimator = c.algorithm.adv_estimator
    if estimator in ROLLOUT_ONLY_ESTIMATORS:
        p.append(f"algorithm.adv_estimator={estimator!r} cannot run offline: {ROLLOUT_ONLY_ESTIMATORS[estimator]}")
    loss = c.actor.policy_loss
    if loss.loss_mode == "dro" and loss.dro_beta is None:
        p.append("actor.policy_loss.loss_mode='dro' needs actor.policy_loss.dro_beta > 0 (its quadratic log-ratio "
                 "penalty), e.g. 0.1")  # fmt: skip
    correction = c.algorithm.rollout_correction
    try:
        parse_is_threshold(correction.rollout_is_threshold)
    except ValueError as error:
        p.append(f"algorithm.rollout_correction.{error}")
    if correction.rollout_rs is not None:
        try:
            parse_rs_thresholds(parse_rs_options(correction.rollout_rs), correction.rollout_rs_threshold)
        except ValueError as error:
            p.append(f"algorithm.rollout_correction.{error}")
    elif correction.rollout_rs_threshold is not None:
        p.append("algorithm.rollout_correction.rollout_rs_threshold is set but rollout_rs is not: set rollout_rs "
                 "(e.g. token_k3 or seq_mean_k3), or drop the threshold")  # fmt: skip
    return p


def _guard_problems(c: PPOConfig) -> list[str]:
    """What the watch rules' actions and the evaluation guards need."""
    p = []
    for index, rule in enumerate(c.guards.watch):
        if rule.action == "kl_bump" and not c.needs_reference:
            p.append(f"guards.watch[{index}] ({rule.metric}): action kl_bump needs a KL term (actor.use_kl_loss or "
                     "algorithm.use_kl_in_reward); use warn or lr_backoff")  # fmt: skip
    if c.data.val_files and c.data.task is not None:
        p.append(f"data.val_files is for dataset runs; data.task={c.data.task!r} evaluates on its own held-out "
                 "problems: drop data.val_files")  # fmt: skip
    return p


def _cross_key_problems(c: PPOConfig) -> list[str]:
    """Rules between keys (each key's own choices and range are on its schema field)."""
    p: list[str] = []
    for role in TRAINED_ROLES:
        optim = f"{role}.optim"
        if get(c, f"{optim}.min_lr") > get(c, f"{optim}.lr"):
            p.append(
                f"{optim}.min_lr={get(c, f'{optim}.min_lr')!r}: must not exceed {optim}.lr={get(c, f'{optim}.lr')!r}"
            )
    kl_ctrl = c.algorithm.kl_ctrl
    if kl_ctrl.min_coef > kl_ctrl.max_coef:
        p.append(f"algorithm.kl_ctrl.min_coef={kl_ctrl.min_coef!r}: must not exceed max_coef={kl_ctrl.max_coef!r}")
    if c.trainer.resume_mode == "resume_path" and not c.trainer.resume_from_path:
        p.append("trainer.resume_mode='resume_path' needs trainer.resume_from_path=<checkpoint dir>")
    p += _guard_problems(c)
    if c.trainer.overwrite and c.trainer.resume_mode == "auto":
        p.append(
            "trainer.overwrite=true moves other runs' checkpoints aside, but with trainer.resume_mode='auto' the run "
            "would continue the one `latest` names; set trainer.resume_mode=disable for a new run"
        )
    for logger in ("wandb", "mlflow"):
        if logger in c.trainer.logger and importlib.util.find_spec(logger) is None:
            p.append(
                f"trainer.logger={c.trainer.logger!r}: {logger} is not installed; install the extra (pip install "
                f"'megatron-ppo[{logger}]') or drop {logger} from the list"
            )
    critic_model = c.critic.model
    if critic_model.hf_checkpoint and critic_model.init_checkpoint:
        p.append(
            f"critic.model.hf_checkpoint={critic_model.hf_checkpoint!r} and critic.model.init_checkpoint="
            f"{critic_model.init_checkpoint!r} both name the critic's initial weights; set one of them"
        )
    p += _reward_model_problems(c)
    if (critic_model.hf_checkpoint or critic_model.init_checkpoint) and not c.needs_critic:
        p.append(
            f"critic.model initialises a critic, but algorithm.adv_estimator={c.algorithm.adv_estimator!r} trains "
            "none; unset critic.model.hf_checkpoint / init_checkpoint or use adv_estimator=gae"
        )
    return p


def _reward_model_problems(c: PPOConfig) -> list[str]:
    """The scoring job's weights and layout, when the config names a reward model (its model's own rules, heads
    and layers against TP/PP, are checked against the reward model's config when `score` reads it, before anything
    is built; the tiny task's scoring shares the actor's layout and checks that itself)."""
    p: list[str] = []
    weights, layout = c.reward_model.model, c.reward_model.megatron
    if weights.path and weights.init_checkpoint:
        p.append(f"reward_model.model.path={weights.path!r} and reward_model.model.init_checkpoint="
                 f"{weights.init_checkpoint!r} both name the reward model; set one of them")  # fmt: skip
    if not (weights.path or weights.init_checkpoint):
        return p
    split = layout.tensor_model_parallel_size * layout.pipeline_model_parallel_size * layout.context_parallel_size
    if world_size(c) % split:
        p.append(f"reward_model.megatron: TP×PP×CP = {split} does not divide the world size {world_size(c)} "
                 f"(cluster.nodes × cluster.gpus_per_node); make it one of {divisors(world_size(c))}")  # fmt: skip
    if layout.context_parallel_size > 1 or layout.expert_model_parallel_size > 1:
        p.append("reward_model.megatron: scoring runs under TP and PP (and data parallelism over the rest); set "
                 "context_parallel_size and expert_model_parallel_size to 1")  # fmt: skip
    return p


def _checkpoint_problems(c: PPOConfig) -> list[str]:
    """The RoPE scaling of `model.hf_checkpoint`'s config.json, when it is there: refused where Megatron cannot
    express it, and compared with `model.rope_scaling_factor` (the checkpoint's other keys are compared with the
    recipe when the trainer converts it)."""
    config_json = Path(c.model.hf_checkpoint or "") / "config.json"
    if not c.model.hf_checkpoint or not config_json.is_file():
        return []
    factor, problems = hf_rope_scaling(json.loads(config_json.read_text()))
    if not problems and factor != c.model.rope_scaling_factor:
        wanted = "null (no scaling)" if factor is None else repr(factor)
        problems.append(f"model.rope_scaling_factor={c.model.rope_scaling_factor!r}, but the checkpoint's RoPE "
                        f"scaling factor is {factor!r}; set model.rope_scaling_factor={wanted}")  # fmt: skip
    return [f"model.hf_checkpoint={c.model.hf_checkpoint}: {problem}" for problem in problems]


def _model_problems(c: PPOConfig) -> list[str]:
    m, p = c.model, _checkpoint_problems(c)
    if m.rope_scaling_factor is not None and m.position_embedding_type != "rope":
        p.append(
            f"model.rope_scaling_factor={m.rope_scaling_factor!r} scales RoPE, but model.position_embedding_type="
            f"{m.position_embedding_type!r}; set it to null or use rope"
        )
    if m.kv_channels is None and m.num_attention_heads >= 1 and m.hidden_size % m.num_attention_heads:
        p.append(
            f"model.hidden_size={m.hidden_size} is not divisible by model.num_attention_heads="
            f"{m.num_attention_heads}; change one or set model.kv_channels"
        )
    if m.num_query_groups and m.num_attention_heads % m.num_query_groups:
        p.append(
            f"model.num_attention_heads={m.num_attention_heads} is not divisible by model.num_query_groups="
            f"{m.num_query_groups}; each query group must hold the same number of heads"
        )
    replay = c.actor.router_replay.mode
    if replay != "disabled" and not m.num_experts:
        p.append(
            f"actor.router_replay.mode={replay} replays mixture-of-experts routing, but the model is dense "
            "(model.num_experts=0); set actor.router_replay.mode=disabled"
        )
    longest = c.data.max_length
    if m.position_embedding_type == "learned_absolute" and longest > m.max_position_embeddings:
        p.append(
            f"data.max_prompt_length + data.max_response_length = {longest} exceeds "
            f"model.max_position_embeddings={m.max_position_embeddings}; shorten the data or enlarge the table"
        )
    return p


def _batch_problems(c: PPOConfig) -> list[str]:
    p: list[str] = []
    train = c.data.train_batch_size
    longest = c.data.max_length
    for role in TRAINED_ROLES:
        cfg = get(c, role)
        mini, micro = cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu
        if min(train, mini, 1 if micro is None else micro) < 1:
            continue  # reported by the range check
        if train % mini:
            p.append(
                f"data.train_batch_size={train} is not divisible by {role}.ppo_mini_batch_size={mini}; "
                f"use a mini-batch among {divisors(train)}"
            )
        layout = cfg.megatron
        model_parallel = model_parallel_size(layout)
        if model_parallel < 1 or world_size(c) < 1 or world_size(c) % model_parallel:
            continue  # the layout problem is reported on its own
        dp = data_parallel_size(c, layout)
        if mini % dp:
            p.append(
                f"{role}.ppo_mini_batch_size={mini} is not divisible by the data-parallel size {dp}; "
                f"use a multiple of {dp}"
            )
        elif cfg.use_dynamic_bsz:
            if cfg.ppo_max_token_len_per_gpu < longest:
                p.append(
                    f"{role}.ppo_max_token_len_per_gpu={cfg.ppo_max_token_len_per_gpu} is below one full "
                    f"sequence ({longest} = max_prompt_length + max_response_length); raise it"
                )
        elif micro is None:
            p.append(f"{role}.ppo_micro_batch_size_per_gpu is unset; set it or use_dynamic_bsz=true")
        elif (mini // dp) % micro:
            p.append(
                f"{role}.ppo_mini_batch_size={mini} over data-parallel size {dp} gives {mini // dp} rows per "
                f"rank, not divisible by {role}.ppo_micro_batch_size_per_gpu={micro}; use a micro-batch among "
                f"{divisors(mini // dp)}"
            )
    return p


def _kl_problems(c: PPOConfig) -> list[str]:
    p: list[str] = []
    kl = c.algorithm.kl_ctrl
    prefix = "algorithm.kl_ctrl"
    unknown_terms = sorted(set(kl.apply_to) - {"loss", "reward"})
    if unknown_terms:
        p.append(f"{prefix}.apply_to={kl.apply_to!r}: unknown {unknown_terms}; use 'loss' and/or 'reward'")
    driven = [
        t
        for t in kl.apply_to
        if (t == "loss" and c.actor.use_kl_loss) or (t == "reward" and c.algorithm.use_kl_in_reward)
    ]
    if kl.type != "fixed" and not driven:
        p.append(
            f"{prefix}.type={kl.type!r} drives no KL term: enable actor.use_kl_loss or "
            f"algorithm.use_kl_in_reward and list it in {prefix}.apply_to, or set {prefix}.type=fixed"
            + (f" ~{prefix}.stages" if kl.stages else "")
        )
    if kl.band is not None:
        p += _band_problems(f"{prefix}.band", kl.band)
    uses_pi = kl.type == "pi" or (kl.type == "staged" and any(s.controller == "pi" for s in kl.stages))
    if uses_pi and kl.min_coef <= 0:
        p.append(
            f"{prefix}.min_coef={kl.min_coef!r}: the pi controller steers log β and needs min_coef > 0 (e.g. 1e-6)"
        )
    if kl.type != "staged":
        if kl.stages:
            p.append(f"{prefix}.stages is set but {prefix}.type={kl.type!r}; set type=staged or drop the stages")
        return p
    if not kl.stages:
        return [*p, f"{prefix}.type='staged' needs {prefix}.stages (see configs/kl/staged.yaml)"]
    guard_names = {f.name for f in dataclasses.fields(GuardsConfig) if f.name != "watch"}  # thresholds only
    names = [s.name for s in kl.stages]
    for name in {n for n in names if names.count(n) > 1}:
        p.append(f"{prefix}.stages: the name {name!r} is used twice; stage names must be unique")
    total = c.trainer.total_training_steps
    previous_end = 0.0
    for index, stage in enumerate(kl.stages):
        key = f"{prefix}.stages[{index}] ({stage.name})"
        if stage.end <= previous_end:
            p.append(f"{key}.end={stage.end}: stages must be ordered, each ending after the previous ({previous_end})")
        if kl.stage_unit == "fraction" and not 0 < stage.end <= 1:
            p.append(f"{key}.end={stage.end}: with stage_unit='fraction' an end is a fraction of the run in (0, 1]")
        previous_end = stage.end
        if stage.controller not in (allowed := choices_of(KLStageConfig, "controller")):
            p.append(f"{key}.controller={stage.controller!r} is not one of {', '.join(allowed)}")
        if stage.controller == WARMUP and index > 0:
            p.append(f"{key}: only the first stage may be a warm-up (a later ramp from 0 breaks β's continuity)")
        needs_target = stage.controller in ("adaptive", "power_law", "pi") or (
            stage.controller == "band" and stage.band is None
        )
        if needs_target and (stage.target_kl is None or stage.target_kl <= 0):
            p.append(f"{key}.target_kl={stage.target_kl!r}: a {stage.controller} stage needs a target KL > 0")
        if stage.band is not None:
            p += _band_problems(f"{key}.band", stage.band)
        if stage.horizon <= 0 or stage.alpha <= 0:
            p.append(f"{key}: horizon={stage.horizon} and alpha={stage.alpha} must be > 0")
        if stage.kp < 0 or stage.ki <= 0 or stage.rate_limit <= 1:
            p.append(f"{key}: the pi gains need kp ≥ 0 (got {stage.kp}), ki > 0 (got {stage.ki}) and rate_limit > 1 "
                     f"(got {stage.rate_limit})")  # fmt: skip
        for guard in sorted(set(stage.guards) - guard_names):
            p.append(f"{key}.guards.{guard}: unknown guard; known: {', '.join(sorted(guard_names))}")
    last = kl.stages[-1].end
    if kl.stage_unit == "fraction" and last != 1.0:
        p.append(f"{prefix}.stages[-1].end={last}: the stages must cover the whole run; end the last one at 1.0")
    if kl.stage_unit == "step" and total is not None and last < total:
        p.append(
            f"{prefix}.stages[-1].end={last}: the stages must cover trainer.total_training_steps={total}; "
            f"end the last one at {total} or later"
        )
    return p


def _band_problems(key: str, band: list[float]) -> list[str]:
    if len(band) != 2 or not 0 <= band[0] < band[1]:
        return [f"{key}={list(band)!r}: a KL band is [low, high] with 0 ≤ low < high"]
    return []


def _reward_problems(c: PPOConfig) -> list[str]:
    p: list[str] = []
    clip = c.reward.clip_range
    if clip is not None and (len(clip) != 2 or clip[0] >= clip[1]):
        p.append(f"reward.clip_range={list(clip)!r}: give [low, high] with low < high, e.g. [-2, 2]")
    custom = c.reward.custom_fn
    if c.reward.score_fn == "custom" and not custom.path:
        p.append("reward.score_fn='custom' needs reward.custom_fn.path (a .py file) and reward.custom_fn.name")
    if c.reward.score_fn is not None and c.data.task == "addition":
        p.append(
            f"reward.score_fn={c.reward.score_fn!r} scores rows without a reward, but data.task='addition' writes "
            "its rewards into its rows; unset reward.score_fn"
        )
    if custom.path and c.reward.score_fn == "verl":
        p.append(
            f"reward.custom_fn.path={custom.path!r} is set but reward.score_fn='verl'; choose one: "
            "reward.score_fn=custom to score rows with your function, or drop the path"
        )
    return p
