"""Starting and ending a run: process groups, initial weights, and offline PPO on the configured dataset."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from megatron_ppo.checkpoint import directory
from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.checkpoint.run_start import check_directories
from megatron_ppo.checkpoint.shapes import resume_problems
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.layout import world_size
from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.convert.critic_init import converted_critic_checkpoint
from megatron_ppo.convert.huggingface import converted_init_checkpoint
from megatron_ppo.data.parse import Tokenizer
from megatron_ppo.data.prepare import PreparedData, prepared_root, prepared_rows
from megatron_ppo.data.rows import DataReport
from megatron_ppo.data.scoring import Scorer, build_scorer
from megatron_ppo.data.tokenizer import load_tokenizer
from megatron_ppo.data.values import RoutingShape
from megatron_ppo.parallel import DistEnv, destroy_distributed, dist_env_from_environment, init_distributed
from megatron_ppo.parallel.ranks import describe_rank
from megatron_ppo.train.evaluation import ValidationSet
from megatron_ppo.train.experience import check_rows_for_rollout_correction
from megatron_ppo.train.ppo import PPOTrainer


def check_launch(config: PPOConfig) -> DistEnv:
    """Before any process group or model: the processes started are the config's, the run's directories are
    writable (`check_directories`), and the checkpoint a resume would load holds the config's model
    (`resume_problems`). Returns this process's place in the launch."""
    env = dist_env_from_environment()
    expected = world_size(config)
    if env.world_size != expected:
        raise ConfigError(
            [f"{env.world_size} process(es) started, but cluster.nodes × cluster.gpus_per_node = {expected}; launch "
             f"with `torchrun --nproc_per_node {expected} -m megatron_ppo train ...` or set cluster.gpus_per_node"]
        )  # fmt: skip
    check_directories(config)
    if problems := resume_problems(config):
        raise ConfigError(problems)
    return env


@contextmanager
def distributed_run(config: PPOConfig) -> Iterator[InitialWeights]:
    """Check the launch against the config, start the process groups, convert `model.hf_checkpoint` (and the
    critic's `critic.model.hf_checkpoint`) on first use; yields the run's initial weights (`InitialWeights`: the
    configured checkpoints, or those conversions); tears the groups down on the way out."""
    env = check_launch(config)
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


def other_reward_models(config: PPOConfig, *reports: DataReport) -> list[str]:
    """A line for each data file scored (`megatron-ppo score`) by another reward model than `reward_model.model.*`
    names, when it names one: the run's rewards are that model's."""
    weights = config.reward_model.model
    named = weights.path or weights.init_checkpoint
    if not named:
        return []
    if weights.init_checkpoint and os.path.isdir(named):  # scoring names the checkpoint a root resolves to
        named = str(directory.find_resumable(named) or named)
    lines = []
    for report in reports:
        for path, info in report.scored_by.items():
            scorer = info.get("reward_model")
            if scorer and os.path.realpath(scorer) != os.path.realpath(named):
                lines.append(f"{path} was scored by the reward model {scorer} (checkpoint "
                             f"{info.get('checkpoint_hash')}), not by {named}, which reward_model.model.* names: "
                             f"its rewards are {scorer}'s")  # fmt: skip
    return lines


def require_data(config: PPOConfig) -> None:
    if not config.model.tokenizer or not config.data.train_files:
        raise ConfigError(["offline PPO needs model.tokenizer (.model or tokenizer.json) and data.train_files"])


@dataclasses.dataclass(frozen=True)
class RunData:
    """A run's rows, prepared and opened, with the tokenizer and scorer that made them."""

    train: PreparedData
    val: PreparedData | None
    tokenizer: Tokenizer
    scorer: Scorer | None


def prepare_data(config: PPOConfig) -> RunData:
    """`data.train_files` (and `data.val_files`) prepared under `data.prepared_dir` once — by one process of the
    job, the others waiting — and opened (`data/prepare.py`); what `megatron-ppo prepare` runs on a CPU node."""
    require_data(config)
    scorer = build_scorer(config.reward)  # a missing verl or custom file fails at once
    tokenizer = load_tokenizer(config.model.tokenizer)
    model, routing = config.model, None  # R3: the rows' routed experts, checked against the model
    if config.actor.router_replay.mode == "R3":
        routing = RoutingShape(model.num_layers, model.num_experts_per_tok, model.num_experts)
    root = prepared_root(config)
    train = prepared_rows(config.data.train_files, tokenizer, config.data, root, scorer, routing)
    check_rows_for_rollout_correction(config, train.rows)
    val = prepared_rows(config.data.val_files, tokenizer, config.data, root, scorer) if config.data.val_files else None
    return RunData(train, val, tokenizer, scorer)


def train(config: PPOConfig) -> list[dict[str, float]]:
    """Offline PPO on `data.train_files`: the metrics of every iteration."""
    require_data(config)
    model = config.model
    if not (model.init_checkpoint or model.hf_checkpoint or model.allow_random_init):
        raise ConfigError([
            "model: no initial weights — offline PPO from a random network trains nothing useful; set "
            "model.hf_checkpoint=<Hugging Face dir> or model.init_checkpoint=<megatron-ppo checkpoint> "
            "(or model.allow_random_init=true for a smoke test: the reference then copies the actor)"
        ])  # fmt: skip
    check_launch(config)
    # the data before any process group or model (a conversion of model.hf_checkpoint builds one): a bad row, or
    # rows lacking what the config asks of them, fail at once
    data = prepare_data(config)
    rows, report, val_data = data.train.rows, data.train.report, data.val
    with distributed_run(config) as weights:
        validation = None
        if val_data is not None:  # a validation set is small: its rows are held
            validation = ValidationSet(list(val_data.rows), data.tokenizer, data.scorer,
                                       config.data.max_response_length,
                                       config.actor.log_prob_micro_batch_size_per_gpu)  # fmt: skip
        trainer = PPOTrainer(config, rows, data.tokenizer.pad_id, evaluate=validation, weights=weights)
        trainer.logger.event(0, "data", f"{data.train.line()}; {report.summary()}")
        if val_data is not None:
            trainer.logger.event(0, "data", f"validation: {val_data.line()}; {val_data.report.summary()}")
        for line in other_reward_models(config, report, *([val_data.report] if val_data is not None else [])):
            trainer.logger.event(0, "data", line)
        trainer.resume()
        try:
            return trainer.fit()
        finally:
            trainer.close()
