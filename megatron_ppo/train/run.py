"""Starting and ending a run: process groups, initial weights, and offline PPO on the configured dataset."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.layout import world_size
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.convert.critic_init import converted_critic_checkpoint
from megatron_ppo.convert.huggingface import converted_init_checkpoint
from megatron_ppo.data.rows import read_rows
from megatron_ppo.data.scoring import build_scorer
from megatron_ppo.data.tokenizer import load_tokenizer
from megatron_ppo.data.values import RoutingShape
from megatron_ppo.parallel import destroy_distributed, dist_env_from_environment, init_distributed
from megatron_ppo.parallel.ranks import describe_rank
from megatron_ppo.train.evaluation import ValidationSet
from megatron_ppo.train.ppo import PPOTrainer


@contextmanager
def distributed_run(config: PPOConfig) -> Iterator[InitialWeights]:
    """Check the launch against the config, start the process groups, convert `model.hf_checkpoint` (and the
    critic's `critic.model.hf_checkpoint`) on first use; yields the run's initial weights (`InitialWeights`: the
    configured checkpoints, or those conversions); tears the groups down on the way out."""
    env = dist_env_from_environment()
    expected = world_size(config)
    if env.world_size != expected:
        raise ConfigError(
            [f"{env.world_size} process(es) started, but cluster.nodes × cluster.gpus_per_node = {expected}; launch "
             f"with `torchrun --nproc_per_node {expected} -m megatron_ppo train ...` or set cluster.gpus_per_node"]
        )  # fmt: skip
    os.makedirs(config.trainer.default_local_dir, exist_ok=True)
    init_distributed(config.actor.megatron, seed=config.trainer.seed, device=config.cluster.device)
    try:
        host = os.environ.get("SLURMD_NODENAME", socket.gethostname())
        print(f"rank {env.rank}/{env.world_size} (local {env.local_rank}) on {host}: {describe_rank()}", flush=True)
        weights = InitialWeights.of(config)
        if config.model.hf_checkpoint and not weights.actor:
            cache = os.path.join(config.trainer.default_local_dir, "hf_init")
            actor = converted_init_checkpoint(config.model.hf_checkpoint, cache, config.model, config.actor.megatron)
            weights = dataclasses.replace(weights, actor=str(actor))
        critic = config.critic.model
        if critic.hf_checkpoint and not weights.critic:
            cache = os.path.join(config.trainer.default_local_dir, "hf_init_critic")
            converted = converted_critic_checkpoint(critic.hf_checkpoint, cache, config.model, config.critic.megatron)
            weights = dataclasses.replace(weights, critic=str(converted))
        yield weights
    finally:
        destroy_distributed()


def train(config: PPOConfig) -> list[dict[str, float]]:
    """Offline PPO on `data.train_files`: the metrics of every iteration."""
    if not config.model.tokenizer or not config.data.train_files:
        raise ConfigError(["offline PPO needs model.tokenizer (.model or tokenizer.json) and data.train_files"])
    model = config.model
    if not (model.init_checkpoint or model.hf_checkpoint or model.allow_random_init):
        raise ConfigError([
            "model: no initial weights — offline PPO from a random network trains nothing useful; set "
            "model.hf_checkpoint=<Hugging Face dir> or model.init_checkpoint=<megatron-ppo checkpoint> "
            "(or model.allow_random_init=true for a smoke test: the reference then copies the actor)"
        ])  # fmt: skip
    scorer = build_scorer(config.reward)  # before any process group: a missing verl or custom file fails at once
    with distributed_run(config) as weights:
        tokenizer = load_tokenizer(config.model.tokenizer)
        routing = None  # R3: the rows' routed experts, checked against the model
        if config.actor.router_replay.mode == "R3":
            routing = RoutingShape(model.num_layers, model.num_experts_per_tok, model.num_experts)
        rows, report = read_rows(
            config.data.train_files, tokenizer, config.data,
            rejects_path=os.path.join(config.trainer.default_local_dir, "rejects.jsonl"), scorer=scorer,
            routing=routing,
        )  # fmt: skip
        validation = None
        if config.data.val_files:
            val_rows, val_report = read_rows(
                config.data.val_files, tokenizer, config.data,
                rejects_path=os.path.join(config.trainer.default_local_dir, "val_rejects.jsonl"), scorer=scorer,
            )  # fmt: skip
            validation = ValidationSet(val_rows, tokenizer, scorer, config.data.max_response_length,
                                       config.actor.log_prob_micro_batch_size_per_gpu)  # fmt: skip
        trainer = PPOTrainer(config, rows, tokenizer.pad_id, evaluate=validation, weights=weights)
        trainer.logger.event(0, "data", report.summary())
        if validation is not None:
            trainer.logger.event(0, "data", f"validation: {val_report.summary()}")
        trainer.resume()
        try:
            return trainer.fit()
        finally:
            trainer.close()
