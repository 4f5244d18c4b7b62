"""Code that runs inside the ranks of the KV-cache decoding tests: the same tiny GPT decoded with and without the
cache, layout after layout on one world."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
from megatron.core import parallel_state

from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.models.generation import generate
from megatron_ppo.parallel import init_distributed
from tests.distributed import workers

MODEL = dataclasses.replace(workers.MODEL, name="decode", max_position_embeddings=64)
MOE_MODEL = dataclasses.replace(MODEL, name="decode-moe", num_experts=4, num_experts_per_tok=2)
LAYOUTS: dict[str, tuple[MegatronConfig, ModelConfig]] = {
    "dp2": (MegatronConfig(), MODEL),  # TP1: each replica decodes its share
    "tp2": (MegatronConfig(tensor_model_parallel_size=2), MODEL),
    "tp2-sp": (MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True), MODEL),
    "pp2": (MegatronConfig(pipeline_model_parallel_size=2), MODEL),
    "pp2-vpp2": (MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), MODEL),
    "ep2": (MegatronConfig(expert_model_parallel_size=2), MOE_MODEL),
}
MAX_NEW_TOKENS = 12


def prompts(count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, MODEL.vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(count)]


def cached_against_uncached(rank: int, world_size: int, names: list[str]) -> dict[str, Any]:
    """Per layout: greedy answers (prompts of 3–9 tokens, 7 of them: DP shares differ) with and without the cache,
    with an EOS id that the uncached answers hold mid-way (so rows end at different steps); sampled answers of
    equal-length prompts (the two decoders draw from the same generator in the same order); and, on the last
    stage, whether the cache memory is gone after the call."""
    report: dict[str, Any] = {}
    for name in names:
        layout, model_config = LAYOUTS[name]
        init_distributed(layout, seed=workers.SEED)
        model = build_role_model("ref", model_config, layout)
        with torch.no_grad():  # sharper logits than the 0.02 init: greedy choices with margins well above fp32 noise
            for parameter in (p for chunk in model.chunks for p in chunk.parameters()):
                parameter.mul_(4.0)
        mixed = prompts(7, seed=1, lengths=(3, 9))
        free = generate(model, mixed, max_new_tokens=MAX_NEW_TOKENS, eos_id=-1, pad_id=0, greedy=True,
                        kv_cache=False)  # fmt: skip
        eos = free[0][0][MAX_NEW_TOKENS // 2]  # a token the first answer holds mid-way
        greedy = dict(max_new_tokens=MAX_NEW_TOKENS, eos_id=eos, pad_id=0, greedy=True)
        runs = {cached: generate(model, mixed, **greedy, kv_cache=cached) for cached in (False, True)}
        equal = prompts(6, seed=2, lengths=(5, 5))
        sampling = dict(max_new_tokens=MAX_NEW_TOKENS, eos_id=eos, pad_id=0, temperature=0.7, seed=3)
        sampled = {cached: generate(model, equal, **sampling, kv_cache=cached) for cached in (False, True)}
        report[name] = {
            "uncached": runs[False], "cached": runs[True], "eos": eos,
            "sampled_uncached": sampled[False], "sampled_cached": sampled[True],
            "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        }  # fmt: skip
    return report


def bench_smallest(rank: int, world_size: int) -> dict[str, float]:
    """`make bench`'s decode line at its smallest size (`bench.bench_decode --smallest`)."""
    from bench.bench_decode import main

    return main(["--smallest"])
