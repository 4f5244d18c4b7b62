"""Part (i) of the GPU check: greedy decoding of the (c) model (the 1.5B shape's width, its few layers) with the KV
cache (Megatron-Core's static inference context) and without (every step re-runs the prefix), side by side: tokens/s
of each, their ratio, and how many answers agree token for token (in bf16 the cached decode step and the full
re-run round differently, so greedy answers may part after a near tie; fp32 parity is the CPU tests' job). The
check fails when the cached decoder does not run or, on the GPU, is not faster."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import torch

from gpu_check.sizing import START_S, PartShape, Sized

PROMPT_TOKENS = {"real": 128, "dry": 8}
NEW_TOKENS = {"real": 256, "dry": 8}
DECODE_S = 20.0  # 256 greedy steps cached and uncached at this size


def size(plan) -> Sized:
    """(i)'s model on `plan.card`: its weights, the prompts' forward (all `plan.rows` at once, the planner's count:
    high, the decoder keeps the last position's logits only) and the KV cache of their answers at full length, the
    planner's reservation."""
    from gpu_check.plan import DRY, ppo_config
    from megatron_ppo.planner import plan as planner

    name = "dry" if plan == DRY else "real"
    shape = PartShape(rows=plan.rows, seq=PROMPT_TOKENS[name], micro_batch=plan.rows, layers=plan.shape.layers_c)
    config = ppo_config(plan, shape)
    config.data.max_response_length += NEW_TOKENS[name]  # the cache holds the answers too
    ref = planner.plan_role(config, "ref")
    gib = ref.weights_gib + ref.activations_gib + planner.kv_cache_gib(config, plan.rows) + planner.RESERVED_GIB
    return Sized(shape, gib, gib <= plan.card.budget_gib, fixed_s=START_S + DECODE_S)


def check_decode(plan, work: Path) -> dict[str, Any]:
    from gpu_check.plan import DRY, logprob_model_config
    from megatron_ppo.config.schema import MegatronConfig
    from megatron_ppo.models import build_role_model
    from megatron_ppo.models.generation import timed_generate

    size = "dry" if plan == DRY else "real"
    model = build_role_model("ref", logprob_model_config(plan, plan.dtype), MegatronConfig())
    rng = random.Random(0)
    prompts = [[rng.randrange(1, plan.shape.vocab) for _ in range(PROMPT_TOKENS[size])] for _ in range(plan.rows)]
    out: dict[str, Any] = {"prompts": plan.rows, "prompt_tokens": PROMPT_TOKENS[size], "new_tokens": NEW_TOKENS[size]}
    answers = {}
    for cached in (True, False):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        generation = timed_generate(model, prompts, max_new_tokens=NEW_TOKENS[size], eos_id=-1, pad_id=0,
                                    greedy=True, kv_cache=cached)  # fmt: skip
        seconds = time.perf_counter() - started
        name = "cached" if cached else "uncached"
        out[f"{name}_tokens_per_s"] = generation.tokens / seconds
        answers[cached] = generation.answers
    out["speedup"] = out["cached_tokens_per_s"] / out["uncached_tokens_per_s"]
    out["rows_identical"] = sum(a == b for a, b in zip(answers[True], answers[False], strict=True))
    # the dry run's 8 new tokens are too few for the cache to pay off on a CPU: there it only has to run
    faster = out["speedup"] > 1.0 or plan == DRY
    out["ok"] = faster and all(len(tokens) == NEW_TOKENS[size] for tokens, _ in answers[True])
    return out


def table_lines(i: dict[str, Any]) -> list[str]:
    if "speedup" not in i:
        return [f"(i) KV-cached greedy decoding       FAILED {i.get('error', '')[:300]}"]
    return [f"(i) KV-cached greedy decoding       {'ok' if i['ok'] else 'FAILED'}  {i['prompts']} prompts × "
            f"{i['prompt_tokens']} + {i['new_tokens']} new tokens: cached {i['cached_tokens_per_s']:,.0f} tokens/s, "
            f"uncached {i['uncached_tokens_per_s']:,.0f} ({i['speedup']:.1f}×); {i['rows_identical']}/{i['prompts']} "
            "answers identical"]  # fmt: skip
