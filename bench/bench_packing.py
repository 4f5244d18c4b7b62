"""Packed sequences (`model.pack_sequences`) against padded rows, side by side in one run on 2 processes (TP 2):

1. computed / real tokens of token-budget micro-batches on a skewed length mix (90 % of 15–40 tokens, 10 % of
   400–600) and a spread one (uniform 16–600), padded (rows × the longest row) and packed (Σ lengths), each on CPU
   (no width bucket) and with CUDA's 128-token bucket (`models.widths.width_bucket`);
2. a PPO iteration of the tiny recipe's model at the spread lengths, packed and padded back to back on the same
   batch (the sampler is rewound), under the same token budget, at the CPU's widths and with CUDA's 128-token
   bucket forced (`model.width_multiple`, what a GPU pads to): time per real token (each round's packed / padded
   wall-clock and CPU seconds, and their medians) and the trainer's own `perf/padded_over_real_tokens`;
3. our SDPA attention on a pack (`SDPAttention`, one call per sequence) against one call with a block-diagonal causal
   mask.

Run: torchrun --nproc_per_node 2 -m bench.bench_packing   (or `make bench`); `--smallest` for a seconds-long smoke.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from bench.common import scratch_overrides
from bench.common import smallest as at_smallest
from megatron_ppo.config import load_config
from megatron_ppo.data.batching import dynamic_micro_batches, packed_micro_batches
from megatron_ppo.data.rows import Row
from megatron_ppo.models.attention import SDPAttention
from megatron_ppo.models.packing import build_pack, packed_width
from megatron_ppo.models.widths import padded_width
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.train.ppo import PPOTrainer

BUDGET = 2400  # tokens per micro-batch


def length_mix(kind: str, count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    if kind == "skewed":
        return [rng.randint(400, 600) if rng.random() < 0.1 else rng.randint(15, 40) for _ in range(count)]
    return [rng.randint(16, 600) for _ in range(count)]


def computed_over_real(lengths: list[int], packed: bool, bucket: int) -> float:
    """Tokens the model computes over real tokens for token-budget micro-batches of `lengths`."""
    if packed:
        groups = packed_micro_batches(lengths, BUDGET)
        computed = sum(packed_width([lengths[i] for i in group], 1, bucket) for group in groups)
    else:
        groups = dynamic_micro_batches(lengths, BUDGET)
        computed = sum(len(group) * padded_width(max(lengths[i] for i in group), bucket=bucket) for group in groups)
    return computed / sum(lengths)


def rows_of(lengths: list[int], vocab: int, seed: int) -> list[Row]:
    """Rows of these total lengths (a quarter prompt, the rest response), random tokens and rewards."""
    rng = random.Random(seed)
    rows = []
    for i, length in enumerate(lengths):
        prompt = max(1, length // 4)
        tokens = [rng.randrange(4, vocab) for _ in range(length)]
        rows.append(Row(tokens[:prompt], tokens[prompt:], float(rng.choice([-1, 0, 1])), None, None, f"g{i // 4}",
                        "bench", f"row {i}"))  # fmt: skip
    return rows


def ppo_iterations(smallest: bool) -> dict[int, dict[str, list[float] | float]]:
    """Per width bucket (1: the CPU's widths; 128: CUDA's bucket, `model.width_multiple` forced), each round's
    seconds and CPU seconds (summed over the ranks) of one iteration packed and one padded on the same batch, and
    computed / real tokens. A round runs packed and padded back to back (ABBA order over the rounds), so the ratio
    of a round's two times compares them under the same machine load: on a shared machine the load moves by tens
    of percent from one minute to the next, far more than what packing changes here."""
    count, rounds, longest = (16, 1, 256) if smallest else (128, 4, 1200)  # positions ≥ CUDA's bucket
    config = load_config("recipes/tiny-cpu.yaml", [
        *scratch_overrides("packing"), f"data.train_batch_size={count}", f"model.max_position_embeddings={longest}",
        f"data.max_prompt_length={longest // 2}", f"data.max_response_length={longest // 2}", "trainer.save_freq=0",
        "trainer.test_freq=0",
        *(f"{role}.{key}={value}" for role in ("actor", "critic")
          for key, value in (("ppo_mini_batch_size", count), ("ppo_epochs", 1), ("use_dynamic_bsz", True),
                             ("ppo_max_token_len_per_gpu", BUDGET if not smallest else 256))),
    ])  # fmt: skip
    init_distributed(config.actor.megatron, seed=0)
    rng = random.Random(0)  # prompt ≤ a quarter, response the rest: within the data limits of half the table each
    lengths = [rng.randint(16, 48) if smallest else length for length in length_mix("spread", 4 * count)]
    trainer = PPOTrainer(config, rows_of(lengths, config.model.vocab_size, seed=0), pad_id=0)
    models = [model for model in (trainer.actor, trainer.ref, trainer.critic) if model is not None]

    def iteration(name: str, bucket: int) -> tuple[float, float, float]:
        for model in models:
            model.pack_sequences, model.width_multiple = name == "packed", bucket
        start, cpu = time.perf_counter(), time.process_time()
        metrics = trainer.iteration()
        seconds = time.perf_counter() - start
        cpu_seconds = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
        torch.distributed.all_reduce(cpu_seconds)
        return seconds, float(cpu_seconds), metrics["perf/padded_over_real_tokens"]

    for name in ("packed", "padded"):  # warm-up: each path's first call (allocations) outside the timing
        iteration(name, 1)
    out: dict[int, dict[str, list[float] | float]] = {}
    for bucket in (1, 128):
        result: dict[str, list[float] | float] = {"packed": [], "padded": [], "packed_cpu": [], "padded_cpu": []}
        for round_ in range(rounds):
            state = trainer.sampler.state_dict()
            for name in ("packed", "padded") if round_ % 2 == 0 else ("padded", "packed"):
                trainer.sampler.load_state_dict(state)  # the same batch for both
                seconds, cpu_seconds, result[f"{name}_ratio"] = iteration(name, bucket)
                result[name].append(seconds)  # type: ignore[union-attr]
                result[f"{name}_cpu"].append(cpu_seconds)  # type: ignore[union-attr]
        out[bucket] = result
    trainer.close()
    destroy_distributed()
    return out


def attention_times(smallest: bool) -> dict[str, float]:
    """Forward + backward seconds of one pack's causal attention: our `SDPAttention` on the pack (one SDPA call per
    sequence, `models.attention`), and one SDPA call with a block-diagonal causal mask."""
    lengths = [64] * 4 if smallest else [512, 256, 128, 64, 32, 16, 8, 8] * 2
    heads, head_dim = 4, 32
    pack = build_pack(lengths, row_width=max(lengths), multiple=1)
    total = pack.width
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               attention_dropout=0.0, params_dtype=torch.float32)  # fmt: skip
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=SimpleNamespace(
        tp=SimpleNamespace(size=lambda: 1)))  # fmt: skip
    q, k, v = (torch.randn(total, heads, head_dim, requires_grad=True) for _ in range(3))  # THD [t, heads, hn]
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()

    def per_sequence():
        return attention(q, k, v, None, packed_seq_params=pack.params)

    def block_mask():
        out = F.scaled_dot_product_attention(*(t.permute(1, 0, 2)[None] for t in (q, k, v)), attn_mask=allowed)
        return out[0].permute(1, 0, 2).reshape(total, -1)

    torch.testing.assert_close(per_sequence(), block_mask(), rtol=1e-5, atol=1e-5)
    out = {}
    for name, fn in (("per sequence", per_sequence), ("block mask", block_mask)):
        times = []
        for _ in range(2 if smallest else 7):
            start = time.perf_counter()
            fn().sum().backward()
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    smallest = at_smallest(argv, __doc__)
    torch.set_num_threads(1)
    iterations = ppo_iterations(smallest)
    if os.environ.get("RANK", "0") != "0":  # the lines below are printed once (the process group is gone)
        return
    count = 64 if smallest else 4096
    print(f"computed / real tokens, {count} rows, token-budget micro-batches of {BUDGET}")
    for kind in ("skewed", "spread"):
        lengths = length_mix(kind, count)
        for bucket, where in ((1, "CPU"), (128, "CUDA bucket 128")):
            padded, packed = (computed_over_real(lengths, flag, bucket) for flag in (False, True))
            print(f"  {kind:6s} {where:16s}: padded {padded:.3f}   packed {packed:.3f}")
    print("PPO iteration (tiny recipe's model, TP 2, spread lengths 16–600, the same batches and token budget);")
    print("  packed / padded per round (back to back, ABBA), wall-clock and CPU seconds of both ranks")
    for bucket, result in iterations.items():
        where = "CPU widths" if bucket == 1 else "CUDA bucket 128"
        walls = [a / b for a, b in zip(result["packed"], result["padded"], strict=True)]  # type: ignore[arg-type]
        cpus = [a / b for a, b in zip(result["packed_cpu"], result["padded_cpu"], strict=True)]  # type: ignore[arg-type]
        print(f"  {where:16s}: computed / real tokens padded {result['padded_ratio']:.3f} packed "
              f"{result['packed_ratio']:.3f}; padded {statistics.median(result['padded']) * 1e3:.0f} ms, packed "  # type: ignore[arg-type]
              f"{statistics.median(result['packed']) * 1e3:.0f} ms (medians)")  # type: ignore[arg-type]  # fmt: skip
        print(f"  {'':16s}  time per real token, packed / padded: median {statistics.median(walls):.3f} "
              f"(rounds {' '.join(f'{r:.2f}' for r in walls)}); CPU seconds {statistics.median(cpus):.3f} "
              f"(rounds {' '.join(f'{r:.2f}' for r in cpus)})")  # fmt: skip
    attention = attention_times(smallest)
    print("SDPA on one pack (forward + backward), CPU")
    for name, value in attention.items():
        print(f"  {name:12s}: {value * 1e3:8.2f} ms")
    print(f"  block mask / per sequence: {attention['block mask'] / attention['per sequence']:.2f}")


if __name__ == "__main__":
    main()
