"""PP=2 PPO iterations with one shape per pipeline pass (`variable_seq_lengths` off) against Megatron's shape
exchange before every pipeline message (each micro-batch its own width, the flag on), alternated in one run on
2 processes at the tiny recipe's shapes with micro-batches of 16 rows (so a pass has several widths).

On CPU (gloo) the exchange costs a small extra send/receive and a `.tolist()` per pipeline message, while one
shape costs the padded tokens; what it removes on a GPU — a `torch.cuda.synchronize()` before each message, which
empties the launch queue — does not exist here, so the CPU ratio bounds the padding's cost, not the GPU's gain.

Run: torchrun --nproc_per_node 2 -m bench.bench_pipeline_shapes   (or `make bench`)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from bench.bench_ppo_step import synthetic_rows
from bench.common import scratch_overrides, smallest
from megatron_ppo.config import load_config
from megatron_ppo.models import schedule
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.train.ppo import PPOTrainer

# rounds, rows to draw batches from, batch, mini-batch and micro-batch rows
SIZES = {"full": (4, 1024, 128, 64, 16), "smallest": (1, 64, 32, 32, 8)}
LAYOUT = {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}


def main(argv: Sequence[str] | None = None) -> None:
    rounds, row_count, batch, mini, micro = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    torch.set_num_threads(1)
    config = load_config("recipes/tiny-cpu.yaml", [
        *scratch_overrides("pipeline-shapes"), f"data.train_batch_size={batch}",
        *(f"{role}.megatron.{key}={value}" for role in ("actor", "ref", "critic") for key, value in LAYOUT.items()),
        *(f"{role}.{key}={value}" for role in ("actor", "critic")
          for key, value in (("ppo_mini_batch_size", mini), ("ppo_micro_batch_size_per_gpu", micro))),
    ])  # fmt: skip
    init_distributed(config.actor.megatron, seed=0)
    trainer = PPOTrainer(config, synthetic_rows(row_count, config.model.vocab_size, seed=0), pad_id=0)
    one_shape = schedule.pass_shape

    def exchanged(shapes):  # the former behaviour: every micro-batch its own shape, sent ahead of each message
        return None

    times: dict[str, list[float]] = {"one shape per pass": [], "shapes exchanged": []}
    padding: dict[str, float] = {}
    trainer.iteration()  # warm-up
    for _ in range(rounds):
        for name, rule in (("one shape per pass", one_shape), ("shapes exchanged", exchanged)):
            schedule.pass_shape = rule
            start = time.perf_counter()
            metrics = trainer.iteration()
            times[name].append(time.perf_counter() - start)
            padding[name] = metrics["perf/padded_over_real_tokens"]
    schedule.pass_shape = one_shape
    if dist.get_rank() == 0:
        median = {name: statistics.median(seconds) for name, seconds in times.items()}
        print(f"PP=2 PPO iteration, {config.data.train_batch_size} rows, micro-batches of {micro}, {rounds} rounds")
        for name, seconds in median.items():
            print(f"  {name:20s}: {seconds * 1e3:8.1f} ms   padded / real tokens {padding[name]:.3f}")
        print(f"  ratio one shape / exchanged: {median['one shape per pass'] / median['shapes exchanged']:.3f}")
    trainer.close()
    destroy_distributed()


if __name__ == "__main__":
    main()
