"""Autoregressive decoding with a Megatron policy (no KV cache: each step re-runs the prefix, fine for short tasks).

Used to sample responses (the tiny recipe's offline dataset) and for greedy evaluation. Every tensor-parallel rank draws
the same token from the same gathered logits and seed; the last pipeline stage's tokens are broadcast to the
others; data-parallel replicas decode disjoint shares of the prompts, gathered at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_ppo.models import RoleModel, eval_mode, run_micro_batches
from megatron_ppo.models.moe import finished_everywhere
from megatron_ppo.parallel.collectives import (
    broadcast_from_last_stage,
    data_parallel_share,
    gather_data_parallel,
    undo_share,
)


@torch.no_grad()
def generate(
    model: RoleModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    seed: int = 0,
    batch_size: int = 512,
) -> list[tuple[list[int], bool]]:
    """(response token ids, whether it ended with `eos_id`) for each prompt."""
    share = data_parallel_share(len(prompts))
    generator = torch.Generator().manual_seed(seed)
    mine: list[tuple[list[int], bool]] = []
    with eval_mode(model):
        for start in range(0, len(share), batch_size):
            rows = [list(prompts[i]) for i in share[start : start + batch_size]]
            mine += _decode(model, rows, max_new_tokens, eos_id, pad_id, temperature, greedy, generator)
    return undo_share(gather_data_parallel(mine))


def _decode(model, rows, max_new_tokens, eos_id, pad_id, temperature, greedy, generator):
    prompt_lengths = [len(r) for r in rows]
    finished = [False] * len(rows)
    for _ in range(max_new_tokens):
        lengths = torch.tensor([len(r) for r in rows])
        input_ids = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)

        def last_logits(batch, logits, lengths=lengths):
            last = logits[torch.arange(logits.shape[0]), lengths - 1]
            full = gather_from_tensor_model_parallel_region(last)[:, : model.vocab_size]
            return logits.new_zeros(()), {"logits": full.float().cpu()}  # sampled on the host (its generator)

        outputs = run_micro_batches(model, [{"input_ids": input_ids}], last_logits, forward_only=True)
        next_tokens = None
        if outputs:
            logits = outputs[0]["logits"]
            if greedy:
                next_tokens = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
            next_tokens = next_tokens.tolist()
        next_tokens = broadcast_from_last_stage(next_tokens)
        for i, token in enumerate(next_tokens):
            if not finished[i]:
                rows[i].append(token)
                finished[i] = token == eos_id
        if finished_everywhere(model.config, all(finished)):  # MoE: the expert-parallel ranks stop together
            break
    return [(row[n:], done) for row, n, done in zip(rows, prompt_lengths, finished, strict=True)]
