"""MoE routing replay (R2) on a tiny MoE actor: how far the routing drifts over PPO epochs without replay, and what
replay costs. One process, fp32, the trainer's own experience pass and `update_role`.

Drift: the experience pass records each token's top-k per layer; then the actor is updated for `EPOCHS` epochs
without replay, and before each epoch a record pass of the current weights is compared with the experience's:
the fraction of (token, layer) pairs whose expert set changed — the tokens whose update forward would have gone
to other experts than π_old's. With replay, the same update's `actor/router_replay_mismatch` per epoch.
Cost: one update epoch with and without replay from the same weights, alternated round by round (the ratio is the
median of the rounds'); replay adds the live top-k per layer (for the mismatch) and the targets' gather.

Run: torchrun --nproc_per_node 1 -m bench.bench_router_replay   (or `make bench`; `--smallest`: seconds)
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from functools import partial

import torch

from bench.common import smallest
from megatron_ppo.config.schema import (
    ActorConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
    PPOConfig,
    RouterReplaySettings,
)
from megatron_ppo.config.validate import resolve
from megatron_ppo.data.rows import Row
from megatron_ppo.models import build_role_model, unwrap
from megatron_ppo.models.router_replay import ROUTED_EXPERTS
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.train.batch import collate
from megatron_ppo.train.experience import Experience, forward_passes
from megatron_ppo.train.micro_batching import MicroBatching
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from megatron_ppo.train.update import actor_loss, update_role

SIZES = {"full": (4, 128, 32, 4, 3), "smallest": (2, 64, 8, 2, 1)}  # layers, hidden, rows, epochs, rounds


def bench_model(layers: int, hidden: int) -> ModelConfig:
    return ModelConfig(
        name="bench-moe", num_layers=layers, hidden_size=hidden, num_attention_heads=4, vocab_size=256,
        max_position_embeddings=128, params_dtype="fp32", activation="swiglu", normalization="RMSNorm",
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, make_vocab_size_divisible_by=8,
    )  # fmt: skip


OPTIM = OptimConfig(optimizer="adam", lr=1e-3, weight_decay=0.0, clip_grad=1.0)


def rows(count: int) -> list[Row]:
    rng = random.Random(0)
    return [Row(prompt_ids=[rng.randrange(1, 256) for _ in range(rng.randint(8, 24))],
                response_ids=[rng.randrange(1, 256) for _ in range(rng.randint(8, 40))],
                reward=float(rng.choice([-1, 1])), token_rewards=None, behavior_log_probs=None, uid=f"g{i}",
                data_source="bench", source=f"bench:{i}") for i in range(count)]  # fmt: skip


def changed(a: torch.Tensor, b: torch.Tensor, real: torch.Tensor) -> float:
    """The fraction of real (token, layer) pairs whose expert sets differ between records `a` and `b`."""
    return float((a.sort(-1).values != b.sort(-1).values).any(-1)[real].float().mean())


def main(argv: list[str] | None = None) -> None:
    layers, hidden, ROWS, EPOCHS, ROUNDS = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    MODEL = bench_model(layers, hidden)
    torch.set_num_threads(1)
    init_distributed(MegatronConfig(), seed=0)
    config = PPOConfig(model=MODEL)
    config.actor = ActorConfig(optim=OPTIM, ppo_mini_batch_size=ROWS, ppo_micro_batch_size_per_gpu=ROWS // 2,
                               router_replay=RouterReplaySettings(mode="R2"), use_kl_loss=False)  # fmt: skip
    resolve(config)
    actor = build_role_model("actor", MODEL, MegatronConfig(), routing_replay=True)
    initial = {k: v.detach().clone() for c in actor.chunks for k, v in unwrap(c).state_dict().items()
               if isinstance(v, torch.Tensor)}  # fmt: skip
    batch = collate(rows(ROWS), pad_id=0)
    real = torch.arange(batch["input_ids"].shape[1])[None, :] < batch["lengths"][:, None]
    passes = forward_passes(config, batch, actor, None, None)
    shape = batch["loss_mask"].shape
    advantages = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * batch["loss_mask"]
    replayed = Experience(**batch, **passes, token_level_rewards=torch.zeros(shape), advantages=advantages,
                          returns=torch.zeros(shape))  # fmt: skip
    live = Experience(**{k: v for k, v in replayed.items() if k != ROUTED_EXPERTS})
    one_epoch = dataclasses.replace(config.actor, ppo_epochs=1)
    make_loss = partial(actor_loss, one_epoch, kl_loss_coef=0.0, vocab_size=MODEL.vocab_size)

    def reset():
        for chunk in actor.chunks:
            unwrap(chunk).load_state_dict(initial, strict=False)
        optimizer = build_optimizer(actor, OPTIM, MegatronConfig())
        return optimizer, build_scheduler(optimizer, OPTIM, total_steps=EPOCHS)

    def epoch(experience, optimizer, scheduler):
        return update_role("actor", actor, optimizer, scheduler, experience, config=one_epoch,
                           micro=MicroBatching(rows=ROWS // 2), make_loss=make_loss)  # fmt: skip

    drift, mismatch = [], []
    optimizer, scheduler = reset()
    for _ in range(EPOCHS):  # without replay: the live routing before each epoch against the recorded one
        drift.append(changed(forward_passes(config, batch, actor, None, None)[ROUTED_EXPERTS],
                             passes[ROUTED_EXPERTS], real))  # fmt: skip
        epoch(live, optimizer, scheduler)
    optimizer, scheduler = reset()
    for _ in range(EPOCHS):
        mismatch.append(epoch(replayed, optimizer, scheduler).metrics["actor/router_replay_mismatch"])
    ratios = []
    for _ in range(ROUNDS):
        times = {}
        for name, experience in (("live", live), ("replay", replayed)):
            optimizer, scheduler = reset()
            start = time.perf_counter()
            epoch(experience, optimizer, scheduler)
            times[name] = time.perf_counter() - start
        ratios.append(times["replay"] / times["live"])
    print(f"router replay ({MODEL.num_layers} layers, {MODEL.num_experts} experts top-{MODEL.num_experts_per_tok}, "
          f"{ROWS} rows, lr {OPTIM.lr}): routes changed since the old pass before each epoch without replay "
          f"{', '.join(f'{d:.3f}' for d in drift)}; with R2, actor/router_replay_mismatch per epoch "
          f"{', '.join(f'{m:.3f}' for m in mismatch)}; update epoch time replay / live "
          f"{statistics.median(ratios):.3f} (median of {ROUNDS})")  # fmt: skip
    destroy_distributed()


if __name__ == "__main__":
    main()
