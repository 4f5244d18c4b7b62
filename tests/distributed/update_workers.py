"""Spawned-rank code for the update-path tests: the trainer's own loss functions, micro-batching and steps."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_ppo.algo import LOSS_AGGREGATIONS
from megatron_ppo.config.schema import ActorConfig, CriticConfig, MegatronConfig, OptimConfig
from megatron_ppo.data.rows import Row
from megatron_ppo.models import build_role_model, run_micro_batches
from megatron_ppo.parallel import init_distributed
from megatron_ppo.tasks.addition.sft import run_sft
from megatron_ppo.train.batch import collate, replica_micro_batches
from megatron_ppo.train.experience import Experience
from megatron_ppo.train.micro_batching import MicroBatching
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler, zero_grads
from megatron_ppo.train.update import actor_loss, critic_loss, mini_batch_counts
from tests.distributed.workers import MODEL, OPTIM, experience, gspo_config, rows, weights, with_sequence_is


def _gradient(role_model, optimizer, batch: Experience, micro_batch_size: int, make_loss) -> torch.Tensor:
    """The accumulated gradient (DDP buffers) of one mini-batch cut into micro-batches of `micro_batch_size`."""
    zero_grads(role_model, optimizer)
    _, _, micro = replica_micro_batches(batch, micro_batch_size)
    run_micro_batches(role_model, micro, make_loss(mini_batch_counts(batch)), forward_only=False)
    return torch.cat([p.main_grad.flatten().clone() for c in role_model.chunks for p in c.parameters()])


def gradients_by_cut(rank: int, world_size: int) -> dict[str, dict[int, float]]:
    """For every loss_agg_mode, actor and critic: the largest relative gradient difference of cutting one
    8-row mini-batch into micro-batches of 1, 2 or 4 rows against one micro-batch of 8."""
    init_distributed(MegatronConfig(), seed=0)
    batch = experience(8, seed=3)
    actor = build_role_model("actor", MODEL, MegatronConfig())
    critic = build_role_model("critic", MODEL, MegatronConfig())
    optimizers = {role: build_optimizer(m, OptimConfig(), MegatronConfig()) for role, m in
                  (("actor", actor), ("critic", critic))}  # fmt: skip
    report: dict[str, dict[int, float]] = {}
    for mode in LOSS_AGGREGATIONS:
        # the resolved config gives seq-mean-token-sum-norm a constant divisor (data.max_response_length)
        actor_config = ActorConfig(loss_agg_mode=mode, clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.01,
                                   loss_scale_factor=16)  # fmt: skip
        critic_config = CriticConfig(loss_agg_mode=mode, loss_scale_factor=16)
        losses = {
            "actor": (actor, lambda counts, c=actor_config: actor_loss(c, counts, 0.1, MODEL.vocab_size)),
            "critic": (critic, lambda counts, c=critic_config: critic_loss(c, counts)),
        }
        for role, (role_model, make_loss) in losses.items():
            whole = _gradient(role_model, optimizers[role], batch, 8, make_loss)
            report[f"{role} {mode}"] = {
                size: float((_gradient(role_model, optimizers[role], batch, size, make_loss) - whole).abs().max()
                            / whole.abs().max())
                for size in (1, 2, 4)
            }  # fmt: skip
    # GSPO's sequence ratio and sequence-level importance weights: one per whole row, whatever the cut
    gspo = gspo_config(ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.01, loss_scale_factor=16))
    corrected = with_sequence_is(batch, seed=4)
    make_loss = partial(actor_loss, gspo, kl_loss_coef=0.1, vocab_size=MODEL.vocab_size)
    whole = _gradient(actor, optimizers["actor"], corrected, 8, make_loss)
    report["actor gspo + sequence IS"] = {
        size: float((_gradient(actor, optimizers["actor"], corrected, size, make_loss) - whole)
                    .abs().max() / whole.abs().max())
        for size in (1, 2, 4)
    }  # fmt: skip
    return report


def sft_skip_holds_the_schedule(rank: int, world_size: int) -> dict[str, Any]:
    """SFT on a model whose gradients are NaN: every step is skipped and the learning-rate schedule holds."""
    init_distributed(MegatronConfig(), seed=0)
    actor = build_role_model("actor", MODEL, MegatronConfig())
    optim = dataclasses.replace(OptimConfig(lr=1e-3), lr_warmup_steps=10)
    optimizer = build_optimizer(actor, optim, MegatronConfig())
    scheduler = build_scheduler(optimizer, optim, total_steps=20)
    with torch.no_grad():
        next(actor.chunks[0].parameters()).fill_(math.nan)
    run_sft(actor, optimizer, scheduler, rows(8, seed=1), steps=3, batch_size=4, micro_batch_size=4, clip_grad=1.0,
            pad_id=0, seed=0)  # fmt: skip
    return {"num_steps": scheduler.num_steps, "lr": optimizer.param_groups[0]["lr"]}


def grpo_rows(prompts: int, per_prompt: int, seed: int) -> list[Row]:
    """`per_prompt` scored responses to each prompt with behaviour log-probs, rows shuffled so that a group's rows are
    far apart."""
    rng = random.Random(seed)
    out = []
    for p in range(prompts):
        prompt = [rng.randrange(4, 16) for _ in range(rng.randint(3, 6))]
        for r in range(per_prompt):
            response = [rng.randrange(4, 16) for _ in range(rng.randint(1, 4))]
            out.append(Row(prompt_ids=prompt, response_ids=response, reward=float(rng.choice([-1, 0, 1])),
                           token_rewards=None, behavior_log_probs=[-4 * rng.random() for _ in response], uid=f"p{p}",
                           data_source="test", source=f"test:{p * per_prompt + r}"))  # fmt: skip
    rng.shuffle(out)
    return out


def grpo_through_the_trainer(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The tiny recipe's model under GRPO on grouped rows: batches of whole groups, zero-mean advantages per group,
    two finite iterations with sequence-level importance weights against the rows' behaviour log-probs; the
    reference starts as a copy of the (random) actor."""
    from megatron_ppo.config import load_config
    from megatron_ppo.train.experience import compute_advantages, forward_passes
    from megatron_ppo.train.ppo import PPOTrainer

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
    config = load_config(recipe, [
        "data.task=null", "model.allow_random_init=true", "algorithm.adv_estimator=grpo", "trainer.logger=[]",
        "data.train_batch_size=32", "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=8",
        "critic.ppo_mini_batch_size=16", "critic.ppo_micro_batch_size_per_gpu=8", "trainer.total_training_steps=2",
        f"cluster.gpus_per_node={world_size}", "algorithm.rollout_correction.rollout_is=sequence",
        f"trainer.default_local_dir={root}/checkpoints", f"trainer.log_dir={root}/tensorboard",  # never the recipe's
    ])  # fmt: skip
    init_distributed(config.actor.megatron, seed=0)
    rows = grpo_rows(prompts=24, per_prompt=4, seed=5)
    trainer = PPOTrainer(config, rows, pad_id=0)
    report: dict[str, Any] = {
        "ref_equals_actor": all(
            torch.equal(a, b)
            for a, b in zip(weights(trainer.actor).values(), weights(trainer.ref).values(), strict=True)
        ),
        "critic": trainer.critic is not None,
    }
    state = trainer.sampler.state_dict()
    batch_rows = [rows[i] for i in trainer.sampler.next_batch(config.data.train_batch_size)]
    trainer.sampler.load_state_dict(state)
    report["group_counts"] = sorted(Counter(row.uid for row in batch_rows).values())
    batch = collate(batch_rows, pad_id=0)
    passes = forward_passes(config, batch, trainer.actor, trainer.ref, None)
    experience, _ = compute_advantages(config, batch, passes, None, None)
    report["has_is_weights"] = "rollout_is_weights" in experience
    first_response_token = batch["loss_mask"].argmax(-1)
    advantage = experience["advantages"][torch.arange(len(batch_rows)), first_response_token]
    report["largest_group_mean_advantage"] = max(
        abs(float(advantage[batch["group"] == g].mean())) for g in batch["group"].unique()
    )
    report["history"] = [trainer.iteration() for _ in range(2)]
    trainer.close()
    return report


def kl_probe_through_the_trainer(rank: int, world_size: int, root: str, layout: list[str]) -> dict[str, Any]:
    """The tiny recipe's model with `kl_ctrl.feedback: probe` on 32 rows, one batch of all of them and a probe of
    all of them, in `layout` (overrides of every role's megatron.*): four iterations' metrics, the first a critic
    warm-up, so that the probe after update n and the next batch's `kl/mean` (before update n+1) measure the same
    policy on the same rows."""
    from megatron_ppo.config import load_config
    from megatron_ppo.train.ppo import PPOTrainer

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
    config = load_config(recipe, [
        "data.task=null", "model.allow_random_init=true", "trainer.logger=[]", "data.train_batch_size=32",
        "actor.ppo_mini_batch_size=16", "actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_mini_batch_size=16",
        "critic.ppo_micro_batch_size_per_gpu=8", "trainer.total_training_steps=4",
        f"cluster.gpus_per_node={world_size}", "algorithm.kl_ctrl.feedback=probe", "algorithm.kl_ctrl.probe_rows=64",
        "trainer.critic_warmup=1",
        "algorithm.kl_ctrl.stages=[{name: early, end: 1.0, controller: pi, target_kl: 0.05}]", "actor.optim.lr=1e-3",
        f"trainer.default_local_dir={root}/checkpoints", f"trainer.log_dir={root}/tensorboard", *layout,
    ])  # fmt: skip
    init_distributed(config.actor.megatron, seed=0)
    trainer = PPOTrainer(config, grpo_rows(prompts=8, per_prompt=4, seed=5), pad_id=0)
    report = {"probe_rows": trainer.probe.rows, "history": [trainer.iteration() for _ in range(4)]}
    trainer.close()
    return report


HOST_CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__")


@contextlib.contextmanager
def counting_host_conversions() -> Iterator[tuple[Counter, Callable]]:
    """Counts tensor → Python conversions (each a device synchronisation on CUDA) by method, inside the functions
    wrapped with the yielded `watched(fn)` only; a conversion inside another (float() calls item()) counts once."""
    counts: Counter = Counter()
    state = {"watching": 0, "converting": False}
    originals = {name: getattr(torch.Tensor, name) for name in HOST_CONVERSIONS}

    def counted(name: str):
        def method(self, *args, **kwargs):
            if state["converting"]:
                return originals[name](self, *args, **kwargs)
            if state["watching"]:
                counts[name] += 1
            state["converting"] = True
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                state["converting"] = False

        return method

    def watched(fn: Callable) -> Callable:
        def inner(*args, **kwargs):
            state["watching"] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                state["watching"] -= 1

        return inner

    for name in HOST_CONVERSIONS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts, watched
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def host_conversions_by_cut(rank: int, world_size: int) -> dict[str, dict[int, dict[str, int]]]:
    """Tensor → Python conversions in one real `update_role` (an 8-row mini-batch; actor with KL loss and entropy
    bonus, critic; cut into 1 and into 4 micro-batches) made by Megatron's schedule with the loss functions
    (`run_micro_batches`) and by the metric reduction (`reduce_parts`); the optimizer step is not counted (its
    norm is one number per step, and CPU Adam converts its host-side step counters)."""
    from megatron_ppo.train import update

    init_distributed(MegatronConfig(), seed=0)
    batch = experience(8, seed=3)
    actor_config = ActorConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, entropy_coeff=0.01, use_kl_loss=True,
                               loss_scale_factor=16)  # fmt: skip
    losses = {"actor": lambda counts: actor_loss(actor_config, counts, 0.1, MODEL.vocab_size),
              "critic": lambda counts: critic_loss(CriticConfig(loss_scale_factor=16), counts)}  # fmt: skip
    # one epoch over one mini-batch of 8 rows, the gradient clipped at 1
    role_configs = {"actor": ActorConfig(ppo_mini_batch_size=8), "critic": CriticConfig(ppo_mini_batch_size=8)}
    report: dict[str, dict[int, dict[str, int]]] = {}
    schedule, reduce = update.run_micro_batches, update.reduce_parts
    for role, make_loss in losses.items():
        model = build_role_model(role, MODEL, MegatronConfig())
        optimizer = build_optimizer(model, OptimConfig(), MegatronConfig())
        scheduler = build_scheduler(optimizer, OptimConfig(), total_steps=10)
        report[role] = {}
        for micro_batch_size in (8, 2):
            with counting_host_conversions() as (counts, watched):
                update.run_micro_batches, update.reduce_parts = watched(schedule), watched(reduce)
                try:
                    update.update_role(role, model, optimizer, scheduler, batch, config=role_configs[role],
                                       micro=MicroBatching(rows=micro_batch_size), make_loss=make_loss)  # fmt: skip
                finally:
                    update.run_micro_batches, update.reduce_parts = schedule, reduce
            report[role][8 // micro_batch_size] = dict(counts)
    return report


def sft_under_the_cuda_width_bucket(rank: int, world_size: int, position_embedding_type: str) -> dict[str, float]:
    """The tiny recipe's model shape (2 layers, LayerNorm, GELU, biases, a 16-row position table when learned) at
    TP 2: two SFT steps on rows of ≤ 13 tokens with every width rounded up to the CUDA bucket (128, forced through
    its setting `megatron.make_sequence_length_divisible_by`) and without, from the same weights. Returns the
    largest weight difference relative to the largest step (`diff`), the step relative to the largest weight
    (`moved`), the final NLLs and the padded-over-real token ratios."""
    from megatron_ppo.models import copy_weights
    from megatron_ppo.models.widths import CUDA_WIDTH_BUCKET

    tiny = dataclasses.replace(MODEL, num_layers=2, max_position_embeddings=16, normalization="LayerNorm",
                               activation="gelu", add_bias_linear=True,
                               position_embedding_type=position_embedding_type)  # fmt: skip
    init_distributed(MegatronConfig(tensor_model_parallel_size=2), seed=0)
    optim = dataclasses.replace(OPTIM, clip_grad=1.0)  # Adam with eps = 1: the step is smooth in the gradient
    layouts = [MegatronConfig(tensor_model_parallel_size=2, make_sequence_length_divisible_by=bucket)
               for bucket in (None, CUDA_WIDTH_BUCKET)]  # fmt: skip
    actors = [build_role_model("actor", tiny, layout) for layout in layouts]
    copy_weights(actors[0], actors[1])
    runs = []
    for actor, layout in zip(actors, layouts, strict=True):
        optimizer = build_optimizer(actor, optim, layout)
        scheduler = build_scheduler(optimizer, optim, total_steps=2)
        before = weights(actor)
        nll = run_sft(actor, optimizer, scheduler, rows(8, seed=1), steps=2, batch_size=8, micro_batch_size=4,
                      clip_grad=1.0, pad_id=0, seed=0)  # fmt: skip
        runs.append((before, weights(actor), nll, actor.padding.padded / float(actor.padding.real)))
    (start, plain, nll, ratio), (bucket_start, bucketed, bucket_nll, bucket_ratio) = runs
    scale = max(float(v.abs().max()) for v in plain.values())
    return {
        "same_start": all(torch.equal(v, bucket_start[k]) for k, v in start.items()),
        "moved": max(float((v - start[k]).abs().max()) for k, v in plain.items()) / scale,
        "diff": max(float((v - bucketed[k]).abs().max()) for k, v in plain.items())
        / max(float((v - start[k]).abs().max()) for k, v in plain.items()),
        "nll": nll, "bucket_nll": bucket_nll, "ratio": ratio, "bucket_ratio": bucket_ratio,
    }  # fmt: skip
