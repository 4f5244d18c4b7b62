"""Layout arithmetic: how a role's parallel layout (`<role>.megatron`) splits the job's GPUs. Validation checks the
layouts with it, the planner sizes memory and time with it, the trainer checks its launch against it.

    world = cluster.nodes × cluster.gpus_per_node
    DP    = world / (TP × PP × CP)                                      (the replicas a batch is shared over)
    expert layout: world = expert-TP × EP × expert-DP × PP, expert-TP defaulting to TP (Megatron's expert groups)
"""

from __future__ import annotations

import math

from megatron_ppo.config.schema import MegatronConfig, ModelConfig, PPOConfig


def world_size(c: PPOConfig) -> int:
    return c.cluster.nodes * c.cluster.gpus_per_node


def model_parallel_size(megatron: MegatronConfig) -> int:
    """TP × PP × CP: the GPUs one replica of the role spans."""
    return megatron.tensor_model_parallel_size * megatron.pipeline_model_parallel_size * megatron.context_parallel_size


def data_parallel_size(c: PPOConfig, megatron: MegatronConfig) -> int:
    """DP = world / (TP × PP × CP); only meaningful once the layout validated."""
    return world_size(c) // model_parallel_size(megatron)


def expert_layout(c: PPOConfig, megatron: MegatronConfig) -> tuple[int, int, int]:
    """(EP, expert TP, expert DP) of a role: expert-DP = world / (ETP·EP·PP), at least 1."""
    etp = megatron.expert_tensor_parallel_size or megatron.tensor_model_parallel_size
    ep = megatron.expert_model_parallel_size
    return ep, etp, max(1, world_size(c) // (etp * ep * megatron.pipeline_model_parallel_size))


def divisors(n: int) -> list[int]:
    """The sizes that split `n` evenly (what a layout problem suggests instead)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def padded_vocab_size(model: ModelConfig, tensor_parallel_size: int) -> int:
    """Vocabulary rounded up to a multiple of lcm(make_vocab_size_divisible_by, TP): each TP rank holds an equal
    slice, and with the default of 128 the padded size — so the checkpoint — is the same for every TP in 1..128."""
    multiple = math.lcm(model.make_vocab_size_divisible_by, tensor_parallel_size)
    return math.ceil(model.vocab_size / multiple) * multiple
