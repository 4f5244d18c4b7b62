"""How long a checkpoint stops the training loop, synchronous against asynchronous (`trainer.async_save`), on the tiny
recipe at 2 processes, side by side in one run: the trainer's own keepers save the same trainer state into two
roots, one keeper writing synchronously and one in the background, alternately, an iteration between saves (whose
end finalises the pending asynchronous save, as in `fit`). Blocked: the wall time of `CheckpointKeeper.save` (for
the asynchronous keeper also any wait for the previous write, which an iteration normally hides); printed beside
it, the asynchronous save's finalisation at the iteration's end that publishes it (also time the loop stands still).
Goal: asynchronous ≤ 20 % of synchronous.

What stays synchronous in an asynchronous save is what does not grow with the checkpoint's bytes, bar one copy:
the sharded state dicts, Megatron's plan (its first save of a structure validated, the later ones reusing it:
`store.SavePlans`), the copy of the tensors that are views (on GPUs, the device-to-host copy) and the fork of the
writer. A synchronous save adds the write itself, which at the tiny recipe's size (a few MB) is about as short as
those. `--hidden-size H` widens the model (and narrows the batch to keep iterations short) to show the two apart
at a checkpoint whose write takes seconds.

Measured (2 CPU processes on a 2-core machine shared with a test-suite run, medians of 5 saves; the runs are in
docs/performance.md, "Asynchronous checkpoint saves"): tiny 0.30 at load 1–3 and 0.44–0.72 at load 7–13 (0.42–0.85 with
the finalisation of 26–47 ms), its synchronous save now 150–220 ms, of which the fork, Megatron's plan and the
sharded state dicts alone take 40–70; `--hidden-size 1024` (578 MiB per checkpoint) 0.07, 0.10 with the
finalisation (last measured: 0.13–0.20, 0.31–0.36 with the finalisation).

Run: torchrun --nproc_per_node 2 -m bench.bench_async_save [--smallest] [--hidden-size H]   (or `make bench`)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.bench_ppo_step import synthetic_rows
from bench.common import scratch_overrides, smallest
from megatron_ppo.checkpoint import verify
from megatron_ppo.checkpoint.async_save import SaveTiming
from megatron_ppo.checkpoint.proof import help_prove, proving_together
from megatron_ppo.config import load_config
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.train.checkpoint_keeper import CheckpointKeeper
from megatron_ppo.train.ppo import PPOTrainer

SAVES = 5  # of each kind; --smallest: 1
WIDE_BATCH = 32  # rows per iteration (and mini-/micro-batch) of a widened model: iterations of seconds


def widened(hidden_size: int) -> list[str]:
    """The tiny recipe at `hidden_size` (attention heads of 64), `WIDE_BATCH` rows per iteration."""
    batch = [f"{role}.{key}={WIDE_BATCH}" for role in ("actor", "critic")
             for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu")]  # fmt: skip
    return [f"model.hidden_size={hidden_size}", f"model.num_attention_heads={hidden_size // 64}",
            f"data.train_batch_size={WIDE_BATCH}", *batch]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--hidden-size", type=int, default=None, help="widen the tiny model to this hidden size")
    options, rest = parser.parse_known_args(argv)
    saves = 1 if smallest(rest, __doc__) else SAVES
    overrides = scratch_overrides("async-save") + (widened(options.hidden_size) if options.hidden_size else [])
    config = load_config("recipes/tiny-cpu.yaml", overrides)
    init_distributed(config.actor.megatron, seed=0)
    trainer = PPOTrainer(config, synthetic_rows(4096, config.model.vocab_size, seed=0), pad_id=0)
    root = config.trainer.default_local_dir
    keepers, published = {}, []
    for async_save, kind in ((False, "sync"), (True, "async")):
        changed = with_changes(
            config, {"trainer.async_save": async_save, "trainer.default_local_dir": f"{root}/{kind}"}
        )
        record = published.append if async_save else None
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
    alone_s, shared_s = proof_times(published[-1].path, repeats=3)
    if dist.get_rank() == 0:
        report(blocked, published, saves, config.model.hidden_size)
        print(f"  proving its bytes (resume)  : {alone_s * 1e3:8.1f} ms read by rank 0 alone, {shared_s * 1e3:.1f} ms "
              "by both ranks a share each (median of 3; page cache warm, so the hashing's pace: one machine's "
              "cores either way — across nodes the shares add the nodes' read bandwidth)")  # fmt: skip
    for keeper in keepers.values():
        keeper.close()  # deletes the checkpoints the asynchronous keeper's last publications set aside
    trainer.close()
    destroy_distributed()


def proof_times(checkpoint: Path, repeats: int) -> tuple[float, float]:
    """Seconds to prove `checkpoint`'s bytes (`verify.corruption`): rank 0 reading every file, as before
    `checkpoint/proof.py`, and every rank a share of them, as a resume and a rollback do now (medians)."""
    alone, shared = [], []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        if dist.get_rank() == 0:
            assert verify.corruption(checkpoint) is None
        dist.barrier()
        alone.append(time.perf_counter() - started)
        started = time.perf_counter()
        if dist.get_rank() == 0:
            with proving_together():
                assert verify.corruption(checkpoint) is None
        else:
            help_prove()
        dist.barrier()
        shared.append(time.perf_counter() - started)
    return statistics.median(alone), statistics.median(shared)


def report(blocked: dict[bool, list[float]], published: list[SaveTiming], saves: int, hidden: int) -> None:
    sync_s, async_s = statistics.median(blocked[False]), statistics.median(blocked[True])
    at_ends = [t.finalised_s for t in published if not t.waited_s]  # those an iteration's end published
    finalised_s = statistics.median(at_ends) if at_ends else 0.0
    mib = sum(f.stat().st_size for f in published[-1].path.rglob("*") if f.is_file()) / 2**20
    print(f"checkpoint save, tiny recipe at hidden size {hidden} (actor + critic, optimizer states: {mib:.1f} MiB "
          f"per checkpoint), 2 processes, {saves} save(s) each")  # fmt: skip
    print(f"  synchronous: loop blocked  : {sync_s * 1e3:8.1f} ms per save (median)")
    print(f"  asynchronous: loop blocked : {async_s * 1e3:8.1f} ms per save (median)")
    print(f"  asynchronous: finalisation : {finalised_s * 1e3:8.1f} ms at the iteration's end that publishes it "
          f"(median of {len(at_ends)})")  # fmt: skip
    print(f"  asynchronous: write        : {statistics.median(t.write_s for t in published) * 1e3:8.1f} ms from its "
          "start to its publication (median; an iteration's end or the next save finds it done)")  # fmt: skip
    print(f"  ratio async / sync blocked : {async_s / sync_s:.2f}   (goal ≤ 0.20); with the finalisation: "
          f"{(async_s + finalised_s) / sync_s:.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
