"""The PPO/KL algorithm core: pure torch, no Megatron, no torch.distributed.

Argument order and names mirror `verl.trainer.ppo.core_algos` so a verl user can switch; each function's
docstring states its equation, and tests compare it with verl or a closed form. Policy losses, advantage
estimators, KL estimators, loss aggregations and KL controllers are registries keyed by verl's names.
"""

from megatron_ppo.algo.advantages import (
    ADV_ESTIMATORS,
    GROUPED_ESTIMATORS,
    ROLLOUT_ONLY_ESTIMATORS,
    gae_advantages,
    get_adv_estimator_fn,
    grpo_advantages,
)
from megatron_ppo.algo.aggregation import LOSS_AGGREGATIONS, agg_loss
from megatron_ppo.algo.kl import KL_ESTIMATORS, kl_from_logits, kl_penalty
from megatron_ppo.algo.kl_control import (
    KL_CONTROLLERS,
    AdaptiveKLController,
    BandKLController,
    FixedKLController,
    KLController,
    PIKLController,
    PowerLawKLController,
    build_kl_controller,
)
from megatron_ppo.algo.kl_schedule import KLStage, StagedKLSchedule
from megatron_ppo.algo.logits import entropy_from_logits
from megatron_ppo.algo.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megatron_ppo.algo.policy_loss import POLICY_LOSSES, PolicyLossConfig, get_policy_loss_fn
from megatron_ppo.algo.rewards import (
    RunningRewardNormalizer,
    clip_rewards,
    kl_penalized_rewards,
    scores_to_token_level,
)
from megatron_ppo.algo.rollout_correction import (
    compute_offpolicy_metrics,
    compute_rollout_correction_and_rejection_mask,
    compute_rollout_correction_weights,
    compute_rollout_rejection_mask,
)
from megatron_ppo.algo.value_loss import explained_variance, value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "GROUPED_ESTIMATORS",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "POLICY_LOSSES",
    "ROLLOUT_ONLY_ESTIMATORS",
    "AdaptiveKLController",
    "BandKLController",
    "FixedKLController",
    "KLController",
    "KLStage",
    "PIKLController",
    "PolicyLossConfig",
    "PowerLawKLController",
    "RunningRewardNormalizer",
    "StagedKLSchedule",
    "agg_loss",
    "build_kl_controller",
    "clip_rewards",
    "compute_offpolicy_metrics",
    "compute_rollout_correction_and_rejection_mask",
    "compute_rollout_correction_weights",
    "compute_rollout_rejection_mask",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "get_adv_estimator_fn",
    "get_policy_loss_fn",
    "grpo_advantages",
    "kl_from_logits",
    "kl_penalized_rewards",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "scores_to_token_level",
    "value_loss",
]
