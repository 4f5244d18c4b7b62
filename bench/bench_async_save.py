"""How long a checkpoint stops the training loop, synchronous against asynchronous (`trainer.async_save`), on the tiny
recipe at 2 processes, side by side in one run: the trainer's own keeper saves the same trainer state into two
roots, one keeper writing synchronously and one in the background, alternately, an iteration between saves (whose
end finalises the pending asynchronous save, as in `fit`). Blocked: the wall time of `CheckpointKeeper.save` (for
the asynchronous keeper also any wait for the previous write, which an iteration normally hides). Goal: asynchronous
≤ 20 % of synchronous.

Run: torchrun --nproc_per_node 2 -m bench.bench_async_save [--smallest]   (or `make bench`)
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from bench.bench_ppo_step import synthetic_rows
from bench.common import scratch_overrides, smallest
from megatron_ppo.config import load_config
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper
from megatron_ppo.train.ppo import PPOTrainer

SAVES = 5  # of each kind; --smallest: 1


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    saves = 1 if smallest(argv, __doc__) else SAVES
    config = load_config("recipes/tiny-cpu.yaml", scratch_overrides("async-save"))
    init_distributed(config.actor.megatron, seed=0)
    trainer = PPOTrainer(config, synthetic_rows(4096, config.model.vocab_size, seed=0), pad_id=0)
    root = config.trainer.default_local_dir
    keepers, writes = {}, []
    for async_save, kind in ((False, "sync"), (True, "async")):
        changed = with_changes(
            config, {"trainer.async_save": async_save, "trainer.default_local_dir": f"{root}/{kind}"}
        )
        record = (lambda timing: writes.append(timing.write_s)) if async_save else None
        keepers[async_save] = CheckpointKeeper(changed.trainer, trainer.run.identity, report=record)
    blocked: dict[bool, list[float]] = {False: [], True: []}
    trainer.iteration()  # warm-up: the first iteration's one-time costs stay out of the first save's neighbours
    for _ in range(saves):
        for async_save, keeper in keepers.items():
            trainer.iteration()
            keepers[True].poll()  # an iteration's end: the pending write finalises once every rank is done
            started = time.perf_counter()
            keeper.save(trainer.step, trainer.models, trainer.optimizers, trainer.trainer_state())
            blocked[async_save].append(time.perf_counter() - started)
    trainer.iteration()
    keepers[True].poll()
    keepers[True].wait()
    sync_s, async_s = statistics.median(blocked[False]), statistics.median(blocked[True])
    if dist.get_rank() == 0:
        print(f"checkpoint save, tiny recipe (actor + critic, optimizer states), 2 processes, {saves} save(s) each")
        print(f"  synchronous: loop blocked  : {sync_s * 1e3:8.1f} ms per save (median)")
        print(f"  asynchronous: loop blocked : {async_s * 1e3:8.1f} ms per save (median)")
        print(
            f"  asynchronous: write        : {statistics.median(writes) * 1e3:8.1f} ms from its start to its "
            "publication (median; an iteration's end or the next save finds it done)"
        )
        print(f"  ratio async / sync blocked : {async_s / sync_s:.2f}   (goal ≤ 0.20)")
    trainer.close()
    destroy_distributed()


if __name__ == "__main__":
    main()
