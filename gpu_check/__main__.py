"""The GPU check: each part in a process of its own, its result printed and written the moment it ends.

    python -m gpu_check [--dry-run] [--parts a,b,...] [--jobs N] [--out FILE] [--part-timeout S]

Each part runs in a fresh process, so what one part leaves on the GPU — a failed pass, a fragmented allocator, a CUDA
context — never reaches the next, and a part that crashes or hangs (`--part-timeout`: killed with every process it
started, torchrun's workers included) fails alone. Results stream: a part's table lines are printed and the JSON
(`--out`) rewritten as each ends, so a run cut short still reports every finished part. Up to `--jobs` parts run at once
(default 2), but a part whose timings a neighbour's kernels would distort (`exclusive`: the (b) iterations) runs alone,
and two parts that each hold a 1.5B-shaped trainer (`large`: 60–80 GiB each) never run together. The exit status is 1
when a part failed.
`--dry-run` runs every part's code on the CPU with a tiny model (CI does, in tests/e2e).

The parts (`parts.py`):
    (a) the tiny recipe end to end on CUDA through the real CLI (TP=1, bf16): exit 0, held-out accuracy rises;
    (b) a Qwen2.5-1.5B-shaped PPO iteration (28 layers, hidden 1536, 12 heads / 2 query groups, FFN 8960,
        vocabulary 151,936, bf16), packed, 64 rows × 1024 and 16 rows × 4096 tokens, micro-batch 4
        (`ppo_iteration.py`);
    (c) log-probs of the same weights, GPU bf16 against CPU fp32 (`logprobs.py`);
    (d) the (b) iteration with host offload off and on: peak memory beside the planner's (`offload.py`);
    (e) one actor mini-batch's gradient norm cut into 1, 2 and 4 micro-batches (`grad_cut.py`);
    (f) save + resume, same layout, at the 1.5B width with a few layers: every metric bitwise (`resume.py`);
    (g) the first iteration, actor = behaviour policy: |PPO KL| < 1e-6, clip fraction 0; then the trainer dropped
        gives back every byte it allocated (`first_update.py`);
    (h) with 2 GPUs (else skipped): TP2 + SP and PP2 against TP1, and the tiny recipe at TP2 + SP (`layouts.py`);
    (i) greedy decoding with the KV cache against the uncached decoder (`decode.py`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

from gpu_check.parts import Part, parts_of, run_part
from gpu_check.plan import DRY, REAL, REPO, Plan

PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron_ppo.train.run", "gpu_check.parts"]


def part_processes(plan: Plan) -> mp.context.BaseContext:
    """How a part's process starts. On the CPU (the dry run) forked from a server that has imported torch,
    megatron-core and the check once: a fork, not ~10 s of imports, per part. On CUDA spawned, each importing anew:
    importing megatron-core initialises CUDA in the importing process, which a forked child can then not use
    ("Cannot re-initialize CUDA in forked subprocess", seen on the first H200 run of this driver)."""
    if plan.device == "cuda":
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def kill_tree(pid: int) -> None:
    """SIGKILL the process `pid` and every process under it. Not its process group alone: torchrun starts each worker
    in a session of its own, so a part's training processes would outlive it (on a GPU, holding its memory through
    the parts after it). Each process found is stopped first, and looked under again, so none starts another
    between the listing and the kill."""
    try:
        stopped = {pid: psutil.Process(pid)}
    except psutil.NoSuchProcess:
        return
    frontier = list(stopped.values())
    while frontier:
        found = []
        for process in frontier:
            try:
                process.suspend()
                found.extend(child for child in process.children() if child.pid not in stopped)
            except psutil.NoSuchProcess:
                continue
        stopped |= {child.pid: child for child in found}
        frontier = found
    for process in stopped.values():
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue


class Check:
    """The parts, their processes and the results so far."""

    def __init__(self, plan: Plan, parts: list[Part], out: Path, work: Path, jobs: int, part_timeout: float) -> None:
        self.plan, self.parts, self.out, self.work = plan, parts, out, work
        self.jobs, self.part_timeout = jobs, part_timeout
        self.context = part_processes(plan)
        self.results: dict[str, Any] = {
            "dry_run": plan == DRY, "dtype": plan.dtype, "shape": "tiny (dry run)" if plan == DRY else "1.5B shape",
            "torch": torch.__version__, "device": _device_name(), "parts": {},
        }  # fmt: skip
        self.running: dict[str, tuple[Part, mp.Process, float]] = {}

    def can_start(self, part: Part) -> bool:
        if len(self.running) >= self.jobs:
            return False
        others = [p for p, _, _ in self.running.values()]
        if part.exclusive:
            return not others
        return not any(p.exclusive for p in others) and not (part.large and any(p.large for p in others))

    def start(self, part: Part) -> None:
        work = self.work / part.key
        work.mkdir(parents=True, exist_ok=True)
        arguments = (part, self.plan, work, work / "result.json", work / "log.txt")
        process = self.context.Process(target=run_part, name=f"gpu-check {part.key}", args=arguments)
        process.start()
        self.running[part.key] = (part, process, time.perf_counter())
        print(f"  … {part.key} started", flush=True)

    def finish(self, key: str, timed_out: bool) -> None:
        part, process, started = self.running.pop(key)
        work = self.work / key
        if timed_out:
            kill_tree(process.pid)
        process.join()
        result_path = work / "result.json"
        if result_path.is_file():
            result = json.loads(result_path.read_text())
        else:
            why = f"killed after {self.part_timeout:.0f} s (--part-timeout)" if timed_out else (
                f"its process ended with exit code {process.exitcode} before reporting")  # fmt: skip
            result = {"ok": False, "error": why, "wall_s": time.perf_counter() - started}
        if not result.get("ok"):
            log = (work / "log.txt").read_text(errors="replace") if (work / "log.txt").is_file() else ""
            result["log_tail"] = log[-4000:]
            print(f"--- {key} failed; the end of its log:\n{result['log_tail']}", file=sys.stderr, flush=True)
        for fact in ("kernels", "gpu"):
            if fact in result:
                self.results[fact] = result[fact]
        self.results["parts"][key] = result
        for line in part.table(result):
            print(line, flush=True)
        print(f"  ({key}: {result['wall_s']:.0f} s)", flush=True)
        self.write()

    def write(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.results, indent=2, default=str))

    def run(self) -> int:
        print(f"GPU check · {self.results['device']} · torch {torch.__version__} · {self.results['shape']} · "
              f"parts {', '.join(p.key for p in self.parts)} · up to {self.jobs} at once", flush=True)  # fmt: skip
        started = time.perf_counter()
        pending = list(self.parts)
        while pending or self.running:
            for part in list(pending):
                if self.can_start(part):
                    pending.remove(part)
                    self.start(part)
                elif part.exclusive:  # it waits for the GPU to itself: nothing behind it starts first
                    break
            time.sleep(0.2)
            now = time.perf_counter()
            for key, (_, process, begun) in list(self.running.items()):
                if not process.is_alive():
                    self.finish(key, timed_out=False)
                elif now - begun > self.part_timeout:
                    self.finish(key, timed_out=True)
        self.results["wall_s"] = time.perf_counter() - started
        self.write()
        failed = [key for key, result in self.results["parts"].items() if not result.get("ok")]
        verdict = f"FAILED: {', '.join(failed)}" if failed else "passed"
        print(f"\nGPU check {verdict} in {self.results['wall_s']:.0f} s · {self.results.get('gpu', 'cpu')} · "
              f"kernels: {self.results.get('kernels', 'n/a')}\nresults: {self.out}", flush=True)  # fmt: skip
        return 1 if failed else 0


def _device_name() -> str:
    """The device the parts run on, named without creating a CUDA context in this process (the parts name the GPU
    itself: `device` in their results)."""
    return f"{torch.cuda.device_count()} CUDA GPU(s)" if torch.cuda.is_available() else "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: every part's code, in minutes")
    parser.add_argument("--parts", default="", help="the parts to run, by letter (a,b,...; default: all)")
    parser.add_argument("--jobs", type=int, default=2, help="parts at once at most (exclusive ones run alone)")
    parser.add_argument("--part-timeout", type=float, default=None, help="seconds before a part is killed "
                        "(default 300 on a GPU, 900 in a dry run)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default outputs/gpu_check[_dry].json)")
    args = parser.parse_args(argv)
    plan = DRY if args.dry_run else REAL
    if plan == REAL and not torch.cuda.is_available():
        print("error: the GPU check needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run on a CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    letters = [letter.strip() for letter in args.parts.split(",") if letter.strip()]
    parts = parts_of(plan)
    unknown = sorted(set(letters) - {part.letter for part in parts})
    if unknown:
        print(f"error: no part {', '.join(unknown)}; the parts: {', '.join(sorted({p.letter for p in parts}))}",
              file=sys.stderr)  # fmt: skip
        return 2
    chosen = [part for part in parts if not letters or part.letter in letters]
    out = args.out or REPO / "outputs" / ("gpu_check_dry.json" if args.dry_run else "gpu_check.json")
    timeout = args.part_timeout or (900.0 if args.dry_run else 300.0)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        return Check(plan, chosen, out, Path(work), max(1, args.jobs), timeout).run()


if __name__ == "__main__":
    sys.exit(main())
