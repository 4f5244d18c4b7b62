"""Greedy decoding with the KV cache (Megatron-Core's static inference context) against the uncached decoder, which
re-runs the whole prefix for every new token: tokens/s of each for 64 prompts × 64 and × 256 new tokens, side by
side in one run, and how each one's time grows from 64 to 256 new tokens (×4 is linear in new tokens; the uncached
decoder's prefix re-runs make it grow faster). The tiny recipe's width with RoPE and room for 512 positions; both
decoders must give the same tokens. `--smallest`: 4 prompts × 4 and 8 new tokens (a test runs it in seconds).

Run: torchrun --nproc_per_node 1 -m bench.bench_decode   (or `make bench`)
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.models.generation import generate
from megatron_ppo.parallel import destroy_distributed, init_distributed

MODEL = ModelConfig(
    name="bench-decode", num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=16,
    make_vocab_size_divisible_by=16, max_position_embeddings=512, position_embedding_type="rope",
    normalization="LayerNorm", activation="gelu", add_bias_linear=True, params_dtype="fp32",
)  # fmt: skip
PROMPT_TOKENS = (64, 128)  # an evaluation prompt of a real task (a GSM8K question: ~100 tokens)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smallest", action="store_true", help="4 prompts × 4 and 8 new tokens")
    args = parser.parse_args(argv)
    prompts, lengths = (4, (4, 8)) if args.smallest else (64, (64, 256))
    torch.set_num_threads(1)
    init_distributed(MegatronConfig(), seed=0)
    model = build_role_model("ref", MODEL, MegatronConfig())
    rng = random.Random(0)
    rows = [[rng.randrange(1, MODEL.vocab_size) for _ in range(rng.randint(*PROMPT_TOKENS))] for _ in range(prompts)]
    seconds: dict[tuple[bool, int], float] = {}
    for new_tokens in lengths:
        answers = {}
        for cached in (True, False):
            start = time.perf_counter()
            answers[cached] = generate(model, rows, max_new_tokens=new_tokens, eos_id=-1, pad_id=0, greedy=True,
                                       kv_cache=cached)  # fmt: skip
            seconds[cached, new_tokens] = time.perf_counter() - start
        if answers[True] != answers[False]:
            raise AssertionError(f"cached and uncached greedy answers differ at {new_tokens} new tokens")
    short, long = lengths
    print(f"greedy decoding, {prompts} prompts of {PROMPT_TOKENS[0]}–{PROMPT_TOKENS[1]} tokens, hidden "
          f"{MODEL.hidden_size}, {MODEL.num_layers} layers, RoPE, 1 CPU thread (same tokens both ways)")  # fmt: skip
    print(f"  {'new tokens':>10} {'cached tok/s':>13} {'uncached tok/s':>15} {'cached/uncached':>16}")
    out: dict[str, float] = {}
    for new_tokens in lengths:
        rate = {cached: prompts * new_tokens / seconds[cached, new_tokens] for cached in (True, False)}
        out[f"speedup_{new_tokens}"] = rate[True] / rate[False]
        print(f"  {new_tokens:>10} {rate[True]:13.0f} {rate[False]:15.0f} {out[f'speedup_{new_tokens}']:15.1f}×")
    for cached, name in ((True, "cached"), (False, "uncached")):
        out[f"growth_{name}"] = seconds[cached, long] / seconds[cached, short]
    print(f"  time from {short} to {long} new tokens (×{long // short} is linear): cached ×{out['growth_cached']:.1f}, "
          f"uncached ×{out['growth_uncached']:.1f}")  # fmt: skip
    destroy_distributed()
    return out


if __name__ == "__main__":
    main()
