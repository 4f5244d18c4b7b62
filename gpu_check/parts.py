"""The GPU check's parts: what each runs, how its result reads in the table, its size on the card and how it may
share the GPU.

A part's `run(plan, work)` returns its result (a JSON-able dict with `ok`); `table(result)` its lines; `size(plan)`
its shape on `plan.card`, planned peak and estimated time (`gpu_check.sizing`; the part runs the same shape).
`distributed`: it builds models in its own process, which starts a process group of one rank first. `exclusive`:
its timings are the check's measurements ((b)'s iterations, (d)'s offload transfers, (j)'s kernels), so it runs
alone; the others run beside each other while their planned peaks fit the card together (`gpu_check.schedule`).
`gpus`: the GPUs it needs; with fewer visible the driver reports it skipped without starting it. `letter` selects it
(`--parts b` runs both lengths of (b))."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from gpu_check import (
    decode,
    first_update,
    grad_cut,
    layouts,
    logprobs,
    offload,
    packed_attention,
    ppo_iteration,
    resume,
)
from gpu_check.plan import Plan, tiny_recipe
from gpu_check.sizing import NEGLIGIBLE, START_S, Sized

Result = dict[str, Any]
TINY_RECIPE_S = 133.0  # (a) on the first H200 run (2026-12-04): SFT, 16 PPO steps, evaluations, through torchrun


def negligible(plan: Plan) -> Sized:
    return NEGLIGIBLE


@dataclass(frozen=True)
class Part:
    key: str
    letter: str
    run: Callable[[Plan, Path], Result]
    table: Callable[[Result], list[str]]
    distributed: bool = True
    exclusive: bool = False
    size: Callable[[Plan], Sized] = negligible
    gpus: int = 1


def tiny_recipe_size(plan: Plan) -> Sized:
    """(a), (h)'s recipe: the tiny model (well under a GiB) in a process of torchrun's, the planner's reservation."""
    from megatron_ppo.planner.plan import RESERVED_GIB

    return Sized(None, RESERVED_GIB + 1.0, True, fixed_s=START_S + TINY_RECIPE_S)


def check_tiny_recipe(plan: Plan, work: Path) -> Result:
    """(a): the real CLI under torchrun, one process at TP=1; held-out accuracy from its TensorBoard events."""
    return tiny_recipe(plan, work, "tiny", tensor_parallel=1, sequence_parallel=False)


def tiny_recipe_table(a: Result) -> list[str]:
    if "exit_code" not in a:
        return [f"(a) tiny recipe via the CLI          FAILED {a.get('error', '')[:300]}"]
    detail = f"accuracy {a['accuracy_before']:.3f} → {a['accuracy_after']:.3f}"
    return [f"(a) tiny recipe via the CLI          {'ok' if a['ok'] else 'FAILED'}  {detail}  ({a['seconds']:.0f} s)"]


def parts_of(plan: Plan) -> list[Part]:
    """Every part, in the order they start: the exclusive ones first (the measured iterations and transfers, while
    nothing else runs), then the longest beside the others in the order of their value (`schedule.VALUE_ORDER`)."""
    shape = "tiny (dry run)" if plan.name == "dry" else "1.5B shape"
    iterations = [
        Part(f"b{seq}", "b", partial(ppo_iteration.check_ppo_iteration, seq=seq),
             partial(ppo_iteration.table_lines, shape=shape), exclusive=True,
             size=partial(ppo_iteration.size, seq=seq))
        for seq in plan.seq_lengths
    ]  # fmt: skip
    two = layouts.PROCESSES
    return [
        Part("j", "j", packed_attention.check_packed_attention, packed_attention.table_lines, exclusive=True,
             size=packed_attention.size),
        *iterations,
        Part("d", "d", offload.check_offload, offload.table_lines, exclusive=True, size=offload.size),
        Part("a", "a", check_tiny_recipe, tiny_recipe_table, distributed=False, size=tiny_recipe_size),
        Part("c", "c", logprobs.check_logprobs, logprobs.table_lines, size=logprobs.size),
        Part("g", "g", first_update.check_first_update, first_update.table_lines, size=first_update.size),
        Part("i", "i", decode.check_decode, decode.table_lines, size=decode.size),
        Part("f", "f", resume.check_resume, resume.table_lines, size=resume.size),
        Part("e", "e", grad_cut.check_grad_norm_by_cut, grad_cut.table_lines, size=grad_cut.size),
        Part("h", "h", layouts.check_layouts, layouts.layouts_table_lines, exclusive=True, size=layouts.size,
             gpus=two),
        Part("h_recipe", "h", layouts.check_tiny_recipe_tp2_sp, layouts.recipe_table_lines, distributed=False,
             size=tiny_recipe_size, gpus=two),
    ]  # fmt: skip


def run_part(part: Part, plan: Plan, work: Path, result_path: Path, log_path: Path) -> None:
    """The part's process: its own process group (so a timeout kills what it launched too), its output in its log,
    its models on a fresh process group of one rank where it runs models here; the result (or the error) as JSON."""
    os.setsid()
    with open(log_path, "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = os.fdopen(2, "w", buffering=1)
    started = time.perf_counter()
    try:
        if part.distributed:
            from bench.ports import free_port
            from megatron_ppo.config.schema import MegatronConfig
            from megatron_ppo.parallel import init_distributed

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                              LOCAL_RANK="0")  # fmt: skip
            init_distributed(MegatronConfig(), seed=0, device=plan.device)
        result = part.run(plan, work)
    except Exception as error:  # reported as the part's result
        result = {"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}
        print(result["trace"], file=sys.stderr, flush=True)
    result["wall_s"] = time.perf_counter() - started
    if part.distributed and plan.device == "cuda":
        import torch

        result["gpu"] = torch.cuda.get_device_name()
    result_path.write_text(json.dumps(result, default=str))
