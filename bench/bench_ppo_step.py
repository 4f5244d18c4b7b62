"""One PPO iteration of the tiny recipe's shapes against the bare passes it must do, at TP=2 on 2 processes:
3 forward passes (actor, reference, critic) and `ppo_epochs` forward+backward passes of actor and critic over the
same micro-batches, each with a trivial loss; beside it the recipe's KL probe (one actor forward over its fixed rows
after each update, `train/kl_probe.py`) as its share of the iteration. Also the padding of fixed against token-budget
micro-batches.

Run: torchrun --nproc_per_node 2 -m bench.bench_ppo_step   (or `make bench`)
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
import torch.distributed as dist

from bench.common import measure, scratch_overrides, smallest
from megatron_ppo.config import load_config
from megatron_ppo.data.batching import dynamic_micro_batches, fixed_micro_batches, padding_fraction
from megatron_ppo.data.rows import Row
from megatron_ppo.models import run_micro_batches
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.batch import collate, select
from megatron_ppo.train.ppo import PPOTrainer

# timed repeats, rows to draw batches from, overrides of the tiny recipe's batch sizes (smallest: 32-row batches)
SMALL_BATCHES = [
    "data.train_batch_size=32",
    *(
        f"{role}.{key}=16"
        for role in ("actor", "critic")
        for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu")
    ),
]
SIZES = {"full": (3, 4096, []), "smallest": (1, 64, SMALL_BATCHES)}


def synthetic_rows(count: int, vocab: int, seed: int) -> list[Row]:
    """Prompt and response lengths like the tiny task's (6 + 2..5 tokens), random tokens and rewards."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        prompt = [rng.randrange(4, vocab) for _ in range(6)]
        response = [*(rng.randrange(4, vocab) for _ in range(rng.randint(1, 4))), 3]
        rows.append(Row(prompt, response, float(rng.choice([-1, 0, 1])), None, None, f"g{i // 4}", "bench", f"row {i}"))
    return rows


def bare_passes(trainer: PPOTrainer, batch) -> None:
    config = trainer.config
    micro = [select(batch, g) for g in fixed_micro_batches(batch["lengths"].tolist(), 128)]

    def trivial(b, output):
        return output.float().mean(), {}

    for model in (trainer.actor, trainer.ref, trainer.critic):
        run_micro_batches(model, micro, trivial, forward_only=True)
    for model, epochs in ((trainer.actor, config.actor.ppo_epochs), (trainer.critic, config.critic.ppo_epochs)):
        for _ in range(epochs):
            for start in range(0, len(micro), 1):
                for chunk in model.chunks:
                    chunk.zero_grad_buffer()
                run_micro_batches(model, micro[start : start + 1], trivial, forward_only=False)


def skewed_padding() -> tuple[float, float]:
    rng = random.Random(0)
    lengths = [rng.randint(400, 600) if rng.random() < 0.1 else rng.randint(15, 40) for _ in range(512)]
    fixed = padding_fraction(lengths, fixed_micro_batches(lengths, 4))
    dynamic = padding_fraction(lengths, dynamic_micro_batches(lengths, 2400))
    return fixed, dynamic


def main(argv: Sequence[str] | None = None) -> None:
    repeats, row_count, batch_sizes = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    torch.set_num_threads(1)
    config = load_config("recipes/tiny-cpu.yaml", [*scratch_overrides("ppo-step"), *batch_sizes])
    init_distributed(config.actor.megatron, seed=0)
    rows = synthetic_rows(row_count, config.model.vocab_size, seed=0)
    trainer = PPOTrainer(config, rows, pad_id=0)
    batch = collate(rows[: config.data.train_batch_size], pad_id=0)
    t_ppo, _ = measure(trainer.iteration, repeats)
    t_bare, _ = measure(lambda: bare_passes(trainer, batch), repeats)
    micro = trainer.memory.micro_batching(Phase.EXPERIENCE)["actor"]
    t_probe, _ = measure(lambda: trainer.probe.measure(trainer.actor, micro), repeats)
    tokens = float(batch["lengths"].sum())
    fixed, dynamic = skewed_padding()
    if dist.get_rank() == 0:
        print(f"PPO iteration, tiny recipe shapes ({config.data.train_batch_size} rows, {int(tokens)} tokens), TP=2")
        print(f"  PPO iteration            : {t_ppo * 1e3:8.1f} ms   ({tokens / t_ppo:,.0f} tokens/s)")
        print(f"  bare forward/backward    : {t_bare * 1e3:8.1f} ms")
        print(
            f"  ratio PPO / bare passes  : {t_ppo / t_bare:.2f}   "
            f"(without the KL probe: {(t_ppo - t_probe) / t_bare:.2f})"
        )
        print(
            f"{f'  KL probe ({trainer.probe.rows} rows)':<27}: {t_probe * 1e3:8.1f} ms   "
            f"({t_probe / (t_ppo - t_probe):.2f} of the iteration without it)"
        )
        print("padding fraction, 512 rows, 90 % of 15–40 tokens and 10 % of 400–600 tokens")
        print(f"  fixed (4 rows)           : {fixed:.3f}")
        print(f"  dynamic (2400 tokens)    : {dynamic:.3f}")
    trainer.close()
    destroy_distributed()


if __name__ == "__main__":
    main()
