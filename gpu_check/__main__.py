"""The GPU check: each part in a process of its own, its result printed and written the moment it ends.

    python -m gpu_check [--dry-run [--card h100|h200]] [--parts a,b,...] [--budget S] [--jobs N] [--out FILE]
                        [--part-timeout S]

Each part runs in a fresh process, so what one part leaves on the GPU — a failed pass, a fragmented allocator, a CUDA
context — never reaches the next, and a part that crashes or hangs (`--part-timeout`: killed with every process it
started, torchrun's workers included) fails alone. Results stream: a part's table lines are printed and the JSON
(`--out`) rewritten as each ends, so a run cut short still reports every finished part. The exit status is 1 when a
part failed.

Before any part, the card is read by a process alone on it (`card.py`: memory, its CUDA context, its bf16 matrix
rate), and every part sized to it (`sizing.py`: the largest shape the planner fits in the card's budget, printed
with its planned peak and estimated time). Up to `--jobs` parts run at once (default 2) by `schedule.py`'s rule: a
part whose timings a neighbour would distort (`exclusive`) runs alone, the others together while their planned
peaks fit the card. `--budget` (default `DEFAULT_BUDGET_S` on a GPU) leaves out, least valued first and by name,
the parts the estimated schedule cannot finish in time; a part with more GPUs than are visible is skipped at once.

`--dry-run` runs every part's code on the CPU with a tiny model (CI does, in tests/e2e). `--dry-run --card h100`
(or `h200`) runs nothing: it sizes every real part for that card on the CPU, prints the plan and the estimated
schedule, and fails when a part's planned peak exceeds the card's budget or parts scheduled together do — the
rule CUDA enforces, checked before a GPU is lent.

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
import dataclasses
import json
import multiprocessing as mp
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import torch

from gpu_check import schedule
from gpu_check.card import CARDS, measure_card, named_card
from gpu_check.parts import Part, parts_of, run_part
from gpu_check.plan import DRY, REAL, REPO, Plan
from gpu_check.sizing import Sized

DEFAULT_BUDGET_S = 330.0  # a GPU's 15-minute loan holds its start, this check (≤ 6 minutes with the card's reading)
# and a rerun

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


class CardPlan:
    """Every part sized to `plan.card`, their estimated schedule at `jobs` at once, and what `budget_s` leaves out."""

    def __init__(self, plan: Plan, parts: list[Part], jobs: int, budget_s: float | None, gpus: int | None) -> None:
        """`gpus`: the GPUs visible (None: the dry run's CPU processes, which stand in for any number)."""
        self.plan, self.jobs = plan, jobs
        self.sized: dict[str, Sized] = {part.key: part.size(plan) for part in parts}
        self.skipped = {part.key: f"{gpus} GPU visible" for part in parts
                        if gpus is not None and gpus < part.gpus}  # fmt: skip
        self.over = {key: sized for key, sized in self.sized.items() if not sized.fits and key not in self.skipped}
        runnable = [part for part in parts if part.key not in self.skipped and part.key not in self.over]
        first = f"b{plan.seq_lengths[0]}"
        self.parts, self.left_out = runnable, []
        if budget_s is not None:
            self.parts, self.left_out = schedule.within_budget(
                runnable, budget_s, self.simulate, lambda key: schedule.key_rank(key, first)
            )
        self.slots = self.simulate(self.parts)

    def planned_gib(self, key: str) -> float:
        return self.sized[key].planned_gib

    def seconds(self, key: str) -> float:
        return self.sized[key].seconds(self.plan.card)

    def simulate(self, parts) -> list[schedule.Slot]:
        return schedule.simulate(parts, self.seconds, self.planned_gib, self.jobs, self.plan.card.budget_gib)

    def problems(self) -> list[str]:
        """What CUDA would refuse: a part over the card's budget alone, or parts scheduled together over it."""
        budget = self.plan.card.budget_gib
        alone = [f"({key}) plans {sized.planned_gib:.1f} GiB > {budget:.1f} GiB even at {sized.describe()}"
                 for key, sized in self.over.items()]  # fmt: skip
        return alone + schedule.overcommitted(self.slots, self.planned_gib, budget)

    def lines(self) -> list[str]:
        card = self.plan.card
        lines = [f"card {card.describe()}",
                 f"  {'part':<9}{'planned GiB':>12}{'PFLOP':>7}{'host GB':>8}{'disk GB':>8}{'fixed s':>8}{'est. s':>7}"
                 f"{'start–end s':>14}  shape (sized to the card)"]  # fmt: skip
        slots = {slot.key: slot for slot in self.slots}
        for key, sized in self.sized.items():
            if key in slots:
                when = f"{slots[key].start_s:5.0f}–{slots[key].end_s:<5.0f}"
            else:
                when = "skipped" if key in self.skipped else "left out" if key in self.left_out else "over"
            lines.append(f"  {key:<9}{sized.planned_gib:12.1f}{sized.flops / 1e15:7.1f}{sized.transfer_gb:8.0f}"
                         f"{sized.disk_gb:8.0f}{sized.fixed_s:8.0f}{self.seconds(key):7.0f}{when:>14}  "
                         f"{sized.describe()}")  # fmt: skip
        lines.append(f"  estimated {schedule.makespan(self.slots):.0f} s at {self.jobs} at once"
                     + (f"; left out for time: {', '.join(self.left_out)}" if self.left_out else "")
                     + (f"; skipped: {', '.join(self.skipped)}" if self.skipped else ""))  # fmt: skip
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"card": asdict(self.plan.card), "budget_gib": self.plan.card.budget_gib,
                "sized": {key: {"shape": s.describe(), "planned_gib": s.planned_gib, "fits": s.fits,
                                "flops": s.flops, "transfer_gb": s.transfer_gb, "disk_gb": s.disk_gb,
                                "fixed_s": s.fixed_s, "estimated_s": self.seconds(key), "tried": list(s.tried)}
                          for key, s in self.sized.items()},
                "schedule": [asdict(slot) for slot in self.slots], "left_out": self.left_out,
                "estimated_s": schedule.makespan(self.slots)}  # fmt: skip


class Check:
    """The parts, their processes and the results so far."""

    def __init__(self, plan: Plan, parts: list[Part], out: Path, work: Path, jobs: int, part_timeout: float,
                 budget_s: float | None = None) -> None:  # fmt: skip
        self.plan, self.out, self.work = plan, out, work
        self.jobs, self.part_timeout = jobs, part_timeout
        self.context = part_processes(plan)
        gpus = torch.cuda.device_count() if plan.device == "cuda" else None  # counted without a CUDA context
        self.card_plan = CardPlan(plan, parts, jobs, budget_s, gpus)
        self.parts = self.card_plan.parts
        self.results: dict[str, Any] = {
            "dry_run": plan.name == "dry", "dtype": plan.dtype,
            "shape": "tiny (dry run)" if plan.name == "dry" else "1.5B shape",
            "torch": torch.__version__, "device": _device_name(), "plan": self.card_plan.to_json(), "parts": {},
        }  # fmt: skip
        for key, why in self.card_plan.skipped.items():
            self.results["parts"][key] = {"skipped": why, "ok": True, "wall_s": 0.0}
        for key, sized in self.card_plan.over.items():
            self.results["parts"][key] = {"ok": False, "wall_s": 0.0, "error": f"planned {sized.planned_gib:.1f} "
                                          f"GiB > the card's {plan.card.budget_gib:.1f} GiB even at its smallest "
                                          f"shape ({sized.describe()}): not run"}  # fmt: skip
        self.running: dict[str, tuple[Part, mp.Process, float]] = {}

    def can_start(self, part: Part) -> bool:
        others = [p for p, _, _ in self.running.values()]
        return schedule.admits(part, others, self.card_plan.planned_gib, self.jobs, self.plan.card.budget_gib)

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
        for line in self.card_plan.lines():
            print(line, flush=True)
        self.write()
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
        if self.card_plan.left_out:
            verdict += f" (left out for time: {', '.join(self.card_plan.left_out)})"
        print(f"\nGPU check {verdict} in {self.results['wall_s']:.0f} s · {self.results.get('gpu', 'cpu')} · "
              f"kernels: {self.results.get('kernels', 'n/a')}\nresults: {self.out}", flush=True)  # fmt: skip
        return 1 if failed else 0


def _device_name() -> str:
    """The device the parts run on, named without creating a CUDA context in this process (the parts name the GPU
    itself: `device` in their results)."""
    return f"{torch.cuda.device_count()} CUDA GPU(s)" if torch.cuda.is_available() else "cpu"


def card_plan_only(card_name: str, letters: list[str], jobs: int, budget_s: float | None, out: Path) -> int:
    """`--dry-run --card NAME`: the real parts sized to that card on the CPU, nothing run (module docstring)."""
    plan = dataclasses.replace(REAL, card=named_card(card_name))
    parts = [part for part in parts_of(plan) if not letters or part.letter in letters]
    card_plan = CardPlan(plan, parts, jobs, budget_s, gpus=1)  # one card is what a session is lent
    for line in card_plan.lines():
        print(line, flush=True)
    problems = card_plan.problems()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**card_plan.to_json(), "problems": problems}, indent=2, default=str))
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    print(f"{card_name}: {'FAILED' if problems else 'every part fits'}; plan: {out}", flush=True)
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model: every part's code, in minutes")
    parser.add_argument(
        "--card",
        choices=sorted(CARDS),
        default=None,
        help="with --dry-run: size the real parts for this card and check they fit; nothing runs",
    )
    parser.add_argument("--parts", default="", help="the parts to run, by letter (a,b,...; default: all)")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds the parts may take by the estimate; "
        f"the least valued are left out (default {DEFAULT_BUDGET_S:.0f} on a GPU, none in a dry run)",
    )
    parser.add_argument("--jobs", type=int, default=2, help="parts at once at most (exclusive ones run alone)")
    parser.add_argument("--part-timeout", type=float, default=None, help="seconds before a part is killed "
                        "(default 300 on a GPU, 900 in a dry run)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="JSON results (default outputs/gpu_check[_dry].json)")
    args = parser.parse_args(argv)
    if args.card and not args.dry_run:
        print("error: --card names the card of a dry run; on a GPU the check reads its own", file=sys.stderr)
        return 2
    letters = [letter.strip() for letter in args.parts.split(",") if letter.strip()]
    known = {part.letter for part in parts_of(DRY)}
    unknown = sorted(set(letters) - known)
    if unknown:
        print(f"error: no part {', '.join(unknown)}; the parts: {', '.join(sorted(known))}", file=sys.stderr)
        return 2
    jobs = max(1, args.jobs)
    if args.card:
        out = args.out or REPO / "outputs" / f"gpu_check_plan_{args.card}.json"
        return card_plan_only(args.card, letters, jobs, args.budget, out)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: the GPU check needs a CUDA GPU (torch.cuda.is_available() is False); use --dry-run on a CPU",
              file=sys.stderr)  # fmt: skip
        return 2
    out = args.out or REPO / "outputs" / ("gpu_check_dry.json" if args.dry_run else "gpu_check.json")
    timeout = args.part_timeout or (900.0 if args.dry_run else 300.0)
    budget = args.budget if args.budget is not None or args.dry_run else DEFAULT_BUDGET_S
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        plan = DRY if args.dry_run else dataclasses.replace(REAL, card=measure_card(Path(work)))
        chosen = [part for part in parts_of(plan) if not letters or part.letter in letters]
        return Check(plan, chosen, out, Path(work), jobs, timeout, budget).run()


if __name__ == "__main__":
    sys.exit(main())
