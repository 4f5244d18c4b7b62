"""Autoregressive decoding with a Megatron policy: KV-cached through Megatron-Core's static inference context, or
uncached (each step re-runs the whole prefix: the reference the cached decoder is tested and benchmarked against).

Used to sample responses (the tiny recipe's offline dataset) and for greedy evaluation. Every tensor-parallel rank draws
the same token from the same gathered logits and seed; the last pipeline stage's tokens are broadcast to the
others; data-parallel replicas decode disjoint shares of the prompts, gathered at the end.

Cached decoding (`StaticInferenceContext`, as Megatron's static text-generation controller drives it): a batch of
rows with prompt lengths `p_i` is laid out in one token buffer `[B, max p_i + max_new_tokens]`. The first pass
("prefill") runs positions `[0, min p_i)` of every row and fills each layer's key/value memory
`[max_sequence_length, B, groups/TP, head_dim]`; each later pass runs one position `t - 1` of every row against the
cached keys `[0, t)` (one query, no mask: every cached key is in the past) and predicts position `t`. A row whose
prompt is still longer than `t` keeps its prompt token there, so every row sees exactly the tokens (and positions)
the uncached decoder gives it. Work: O(n) per new token instead of O(n²) for the prefix re-run.
Each pass goes through Megatron's pipeline schedule (`run_micro_batches` with the context): the batch is cut into
PP micro-batches of equal rows (the interleaved schedule's minimum), each writing its rows of the cache
(`batch_size_offset`); sequence parallelism is switched off for the passes (a decode step has one position, which
cannot be split over TP ranks; Megatron's inference does the same). Memory: the cache holds
2 · layers/PP · B · (max p_i + max_new_tokens) · groups/TP · head_dim values per rank (`kv_cache_bytes`); it is
freed when the batch ends.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_ppo.models import RoleModel, eval_mode, run_micro_batches, unwrap
from megatron_ppo.models.moe import equal_tokens_group, finished_everywhere
from megatron_ppo.parallel.collectives import (
    broadcast_from_last_stage,
    data_parallel_share,
    gather_data_parallel,
    undo_share,
)
from megatron_ppo.parallel.device import current_device
from megatron_ppo.planner.phases import GENERATION_BATCH_ROWS, GENERATION_CACHE_SHARE

# The module attributes that switch sequence parallelism on in Megatron's layers (as its inference's
# `set_model_to_sequence_parallel` lists them), besides the config's own flag.
_SEQUENCE_PARALLEL_ATTRIBUTES = ("sequence_parallel", "reduce_scatter_embeddings")


@dataclass(frozen=True)
class Generation:
    """What one `timed_generate` call gave: each prompt's answer and how long the decoding took."""

    answers: list[tuple[list[int], bool]]
    seconds: float

    @property
    def tokens(self) -> int:
        return sum(len(tokens) for tokens, _ in self.answers)

    def metrics(self) -> dict[str, float]:
        """The evaluation's `generation_*` scalars: prompts, tokens generated, seconds, tokens/s."""
        rate = self.tokens / max(self.seconds, 1e-9)
        return {"generation_prompts": float(len(self.answers)), "generation_tokens": float(self.tokens),
                "generation_s": self.seconds, "generation_tokens_per_s": rate}  # fmt: skip


def generate(model: RoleModel, prompts: Sequence[Sequence[int]], **kwargs: Any) -> list[tuple[list[int], bool]]:
    """(response token ids, whether it ended with `eos_id`) for each prompt (`timed_generate`'s answers)."""
    return timed_generate(model, prompts, **kwargs).answers


@torch.no_grad()
def timed_generate(
    model: RoleModel,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    greedy: bool = False,
    seed: int = 0,
    batch_size: int = GENERATION_BATCH_ROWS,
    kv_cache: bool = True,
) -> Generation:
    """(response token ids, whether it ended with `eos_id`) for each prompt, and the seconds it took: at most
    `max_new_tokens` each, greedy or sampled at `temperature`, in batches of at most `batch_size` rows per
    data-parallel replica; with `kv_cache` (and no context parallelism, which cannot split a one-token step),
    through the KV cache, in batches whose cache fits (`cache_rows`)."""
    started = time.perf_counter()
    share = data_parallel_share(len(prompts))
    generator = torch.Generator().manual_seed(seed)
    cached = kv_cache and parallel_state.get_context_parallel_world_size() == 1
    if cached:
        batch_size = cache_rows(model, max(map(len, prompts), default=0) + max_new_tokens, batch_size)
    # MoE's allgather dispatcher: every rank of the expert-parallel group runs the same passes
    num_batches = _largest_in_group(model, -(-len(share) // batch_size)) if cached else -(-len(share) // batch_size)
    mine: list[tuple[list[int], bool]] = []
    with eval_mode(model):
        for index in range(num_batches):
            rows = [list(prompts[i]) for i in share[index * batch_size : (index + 1) * batch_size]]
            if cached:
                mine += _decode_cached(model, rows, max_new_tokens, eos_id, pad_id, temperature, greedy, generator)
            else:
                mine += _decode(model, rows, max_new_tokens, eos_id, pad_id, temperature, greedy, generator)
    answers = undo_share(gather_data_parallel(mine))
    return Generation(answers, time.perf_counter() - started)


def kv_cache_bytes(model: RoleModel, rows: int, max_sequence_length: int) -> int:
    """Bytes of this rank's KV cache for `rows` rows of up to `max_sequence_length` tokens: keys and values of each
    of its layers, `[max_sequence_length, rows, groups/TP, head_dim]` in the parameters' dtype."""
    config = model.config
    tp = config.tensor_model_parallel_size
    layers = sum(len(unwrap(chunk).decoder.layers) for chunk in model.chunks)
    element = torch.empty((), dtype=config.params_dtype).element_size()
    return 2 * layers * rows * max_sequence_length * (config.num_query_groups // tp) * config.kv_channels * element


def cache_rows(model: RoleModel, max_sequence_length: int, at_most: int) -> int:
    """The rows one cached batch decodes: `at_most`, or on CUDA fewer where their cache would take more than
    `GENERATION_CACHE_SHARE` of the free device memory (with what the allocator holds unused); the least over all
    ranks (a pipeline's stages must cut the same batches)."""
    if not torch.cuda.is_available():
        return at_most
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    per_row = max(kv_cache_bytes(model, 1, max_sequence_length), 1)
    rows = torch.tensor([max(1, min(at_most, int(GENERATION_CACHE_SHARE * free // per_row)))], device=current_device())
    if dist.is_initialized():
        dist.all_reduce(rows, op=dist.ReduceOp.MIN)
    return int(rows.item())


def _decode_cached(model, rows, max_new_tokens, eos_id, pad_id, temperature, greedy, generator):
    """Decode `rows` (this replica's prompts, maybe none) through a static KV cache (module docstring); every rank of
    the expert-parallel group runs the same passes (the same buffer shape and step schedule)."""
    lengths = [len(row) for row in rows]
    # the step schedule: prefill up to the shortest prompt, then one position per pass up to the last new token
    first = -_largest_in_group(model, -min(lengths, default=1 << 30))
    end = _largest_in_group(model, max(lengths, default=0) + max_new_tokens)
    count = _largest_in_group(model, len(rows))
    micro = max(parallel_state.get_pipeline_model_parallel_world_size(), 1)
    per_micro = max(-(-count // micro), 1)
    total = micro * per_micro  # real rows, then padding rows (done from the start)
    tokens = torch.full((total, end), pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    prompt_end = torch.tensor(lengths + [end] * (total - len(rows)))
    finished = [False] * len(rows)
    ended = [False] * len(rows)  # with eos_id
    generated = [0] * len(rows)
    context = StaticInferenceContext(max_batch_size=total, max_sequence_length=end)
    with _without_sequence_parallel(model), _only_last_position_to_logits(model):
        for position in range(first, end):  # the pass that predicts `position`
            start = 0 if position == first else position - 1
            step = tokens[:, start:position]
            positions = torch.arange(start, position).expand_as(step)
            micro_batches = [
                {"input_ids": step[i : i + per_micro], "position_ids": positions[i : i + per_micro]}
                for i in range(0, total, per_micro)
            ]
            outputs = run_micro_batches(model, micro_batches, _last_logits(model), forward_only=True,
                                        inference_context=context)  # fmt: skip
            next_tokens = None
            if outputs:
                logits = torch.cat([out["logits"] for out in outputs])
                next_tokens = _pick(logits, temperature, greedy, generator).tolist()
            next_tokens = broadcast_from_last_stage(next_tokens)
            context.increment_sequence_len_offset(position - start)
            if position == first:
                context.enable_decode_mode()
            for i in range(len(rows)):
                if finished[i] or position < prompt_end[i]:
                    continue
                tokens[i, position] = next_tokens[i]
                generated[i] += 1
                ended[i] = next_tokens[i] == eos_id
                finished[i] = ended[i] or generated[i] == max_new_tokens
            if finished_everywhere(model.config, all(finished)):  # MoE: the expert-parallel ranks stop together
                break
    context.key_value_memory_dict.clear()  # the cache's memory goes back before training resumes
    return [(tokens[i, n : n + generated[i]].tolist(), ended[i]) for i, n in enumerate(lengths)]


def _last_logits(model: RoleModel):
    """The schedule's `loss_fn` for a cached pass: the logits of each row's last position (the inference context
    makes the output layer gather them over TP), in fp32 on the host, where the next token is drawn."""

    def loss_fn(batch, logits):
        return logits.new_zeros(()), {"logits": logits[:, -1, : model.vocab_size].float().cpu()}

    return loss_fn


def _pick(logits: torch.Tensor, temperature: float, greedy: bool, generator: torch.Generator) -> torch.Tensor:
    """The next token of each row from its logits `[b, vocab]`: the argmax, or a draw at `temperature`."""
    if greedy:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _largest_in_group(model: RoleModel, value: int) -> int:
    """`value`'s largest over the expert-parallel group that must run the same passes (`moe.equal_tokens_group`);
    `value` itself where no group needs it."""
    group = equal_tokens_group(model.config)
    if group is None:
        return value
    box = torch.tensor([value], device=current_device())
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return int(box.item())


@contextmanager
def _without_sequence_parallel(model: RoleModel) -> Iterator[None]:
    """Sequence parallelism off in `model`'s layers (and config) for the duration, then exactly as it was."""
    if not model.config.sequence_parallel:
        yield
        return
    saved = [
        (module, name, getattr(module, name))
        for chunk in model.chunks
        for module in unwrap(chunk).modules()
        for name in _SEQUENCE_PARALLEL_ATTRIBUTES
        if hasattr(module, name)
    ]
    for module, name, _ in saved:
        setattr(module, name, False)
    model.config.sequence_parallel = False
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
        model.config.sequence_parallel = True


@contextmanager
def _only_last_position_to_logits(model: RoleModel, positions: torch.Tensor | None = None) -> Iterator[None]:
    """The output layer sees only one position of each row of its input `[s, b, h]`: the last (a cached prefill's
    other positions would cost `[b, s, vocab]` gathered logits), or row i's `positions[i]` (the uncached decoder's
    right-padded rows: each one's last real token) — `[1, b, h]` either way. megatron-core 0.16 does the first itself
    under an inference context, later releases only inside their engines' `InferenceMode`. Sequence parallelism
    must be off (`_without_sequence_parallel`): the whole sequence is then on every rank."""

    def select(_layer, args, kwargs):
        hidden = args[0]
        if positions is None:
            return (hidden[-1:], *args[1:]), kwargs
        index = torch.zeros(hidden.shape[1], dtype=torch.long)  # rows the schedule padded on: any position
        index[: len(positions)] = positions
        rows = torch.arange(hidden.shape[1], device=hidden.device)
        return (hidden[index.to(hidden.device), rows].unsqueeze(0), *args[1:]), kwargs

    handles = [
        unwrap(chunk).output_layer.register_forward_pre_hook(select, with_kwargs=True, prepend=True)
        for chunk in model.chunks
        if unwrap(chunk).post_process
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _decode(model, rows, max_new_tokens, eos_id, pad_id, temperature, greedy, generator):
    """Uncached: each step runs every row's whole prefix (right-padded); the output layer computes the logits of
    each row's last token only."""
    prompt_lengths = [len(r) for r in rows]
    finished = [False] * len(rows)
    for _ in range(max_new_tokens):
        lengths = torch.tensor([len(r) for r in rows])
        input_ids = torch.full((len(rows), int(lengths.max())), pad_id, dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)

        def last_logits(batch, logits):
            full = gather_from_tensor_model_parallel_region(logits[:, -1])[:, : model.vocab_size]
            return logits.new_zeros(()), {"logits": full.float().cpu()}  # sampled on the host (its generator)

        with _without_sequence_parallel(model), _only_last_position_to_logits(model, lengths - 1):
            outputs = run_micro_batches(model, [{"input_ids": input_ids}], last_logits, forward_only=True)
        next_tokens = None
        if outputs:
            next_tokens = _pick(outputs[0]["logits"], temperature, greedy, generator).tolist()
        next_tokens = broadcast_from_last_stage(next_tokens)
        for i, token in enumerate(next_tokens):
            if not finished[i]:
                rows[i].append(token)
                finished[i] = token == eos_id
        if finished_everywhere(model.config, all(finished)):  # MoE: the expert-parallel ranks stop together
            break
    return [(row[n:], done) for row, n, done in zip(rows, prompt_lengths, finished, strict=True)]
