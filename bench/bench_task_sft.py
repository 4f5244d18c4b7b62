"""The tiny task's SFT at the PPO run's layout against its own (`recipe.task_layout`: every process a data-parallel
replica), side by side in one run: the same demonstrations, the same steps, alternately (ABBA rounds) on the same 2
CPU processes; milliseconds per SFT step of each and their ratio. The SFT (1000 steps) is most of the time `make
train` and the end-to-end tests spend building the task.

Measured (2 CPU processes, a quiet 2-core machine; docs/performance.md): 159 ms per step at the recipe's TP 2, 78
ms data-parallel (0.49). Tensor parallelism over gloo pays two all-reduces per layer and pass for a model whose
matrices are 128 wide; data parallelism pays one gradient all-reduce per step.

Run: torchrun --nproc_per_node 2 -m bench.bench_task_sft [--smallest]   (or `make bench`)
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from bench.common import smallest
from bench.tiny import SHORT
from megatron_ppo.config import load_config
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.parallel.distributed import initialize_model_parallel, seed_everything
from megatron_ppo.tasks.addition import recipe
from megatron_ppo.tasks.addition.problems import split_problems

STEPS, ROUNDS = 60, 2  # SFT steps per timing, ABBA rounds; --smallest: 2 steps, 1 round


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    quick = smallest(argv, __doc__)
    steps, rounds = (2, 1) if quick else (STEPS, ROUNDS)
    work = "outputs/bench/task-sft"
    config = load_config("recipes/tiny-cpu.yaml", [*SHORT, f"data.addition.work_dir={work}"])
    init_distributed(config.actor.megatron, seed=config.trainer.seed)
    task = config.data.addition
    train, heldout = split_problems(task.num_prompts, task.num_heldout, seed=config.data.seed)
    tokenizer = recipe.task_tokenizer(recipe.task_directory(config), train + heldout)
    rows = recipe.demonstrations(config, tokenizer, train)
    layouts = {"the run's layout": config.actor.megatron, "data-parallel": recipe.task_layout(config.actor.megatron)}
    timings: dict[str, list[float]] = {name: [] for name in layouts}
    for order in ([*layouts], [*reversed(layouts)]) * rounds:
        for name in order:
            initialize_model_parallel(layouts[name])
            seed_everything(config.trainer.seed)
            recipe.sft(config, layouts[name], rows, tokenizer.pad_id, steps=1)  # warm-up: first-call costs
            dist.barrier()
            started = time.perf_counter()
            recipe.sft(config, layouts[name], rows, tokenizer.pad_id, steps=steps)
            dist.barrier()
            timings[name].append((time.perf_counter() - started) / steps)
    if dist.get_rank() == 0:
        run = config.actor.megatron
        print(f"tiny task SFT, {dist.get_world_size()} processes, batch {task.sft_batch_size}, {steps} steps × "
              f"{2 * rounds} timings each (ABBA)")  # fmt: skip
        for name, values in timings.items():
            layout = layouts[name]
            print(f"  {name:17s} (TP {layout.tensor_model_parallel_size}, PP {layout.pipeline_model_parallel_size}, "
                  f"EP {layout.expert_model_parallel_size}): {statistics.median(values) * 1e3:7.1f} ms per step "
                  f"(median; {', '.join(f'{v * 1e3:.1f}' for v in values)})")  # fmt: skip
        ratio = statistics.median(timings["data-parallel"]) / statistics.median(timings["the run's layout"])
        print(f"  data-parallel / the run's layout (TP {run.tensor_model_parallel_size}): {ratio:.2f}")
    destroy_distributed()


if __name__ == "__main__":
    main()
