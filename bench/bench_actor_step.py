"""One actor forward-backward with the PPO loss, against the same tokens through plain Megatron (the same model's
logits into Megatron's fused vocab-parallel cross-entropy, no PPO code), both through Megatron's schedule at TP=1:
the overhead of our path. Times alternate between the two, round by round (the ratio is the median of the rounds').

Run: torchrun --nproc_per_node 1 -m bench.bench_actor_step   (or `make bench`)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from functools import partial

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

from bench.common import measure, smallest
from megatron_ppo import algo
from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models import (
    build_role_model,
    causal_attention_mask,
    run_micro_batches,
    vocab_parallel_log_probs,
)
from megatron_ppo.models.gpt import zero_grad_buffers
from megatron_ppo.parallel import destroy_distributed, init_distributed

MODEL = ModelConfig(
    num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=8192, max_position_embeddings=256,
    params_dtype="fp32", position_embedding_type="rope",
)  # fmt: skip
SMALLEST_MODEL = ModelConfig(
    num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, max_position_embeddings=32,
    params_dtype="fp32", position_embedding_type="rope",
)  # fmt: skip
# the model, micro-batches, rows per micro-batch, sequence length, timed rounds
SIZES = {"full": (MODEL, 4, 4, 256, 5), "smallest": (SMALLEST_MODEL, 2, 2, 16, 1)}


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: Sequence[str] | None = None) -> None:
    shape, micro_batches, micro_batch, seq, repeats = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    torch.set_num_threads(1)
    init_distributed(MegatronConfig(), seed=0)
    actor = build_role_model("actor", shape, MegatronConfig())
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(micro_batches):
        input_ids = torch.randint(0, shape.vocab_size, (micro_batch, seq), generator=gen)
        batches.append(
            {
                "input_ids": input_ids,
                "labels": torch.roll(input_ids, -1, 1),
                "mask": torch.ones(micro_batch, seq),
                "old_log_prob": -torch.rand(micro_batch, seq, generator=gen) * 8,
                "advantages": torch.randn(micro_batch, seq, generator=gen),
            }
        )
    tokens = micro_batches * micro_batch * seq

    def ppo_loss(batch, logits):
        log_prob, entropy = vocab_parallel_log_probs(logits, batch["labels"], with_entropy=True)
        counts = {"batch_num_tokens": tokens}
        config = algo.PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28, global_batch_info=counts)
        pg_loss, metrics = algo.get_policy_loss_fn("vanilla")(
            batch["old_log_prob"], log_prob, batch["advantages"], batch["mask"], "token-mean", config
        )
        return pg_loss - 0.01 * algo.agg_loss(entropy, batch["mask"], "token-mean", **counts), metrics

    def ours() -> None:
        zero_grad_buffers(actor)  # also waits for the last pass's overlapped gradient all-reduce
        run_micro_batches(actor, batches, ppo_loss, forward_only=False)

    def plain_forward_step(data_iterator, model):
        batch = next(data_iterator)
        position_ids = torch.arange(seq).expand(micro_batch, seq)
        logits = model(batch["input_ids"], position_ids, causal_attention_mask(seq))
        return vocab_parallel_cross_entropy(logits, batch["labels"]), partial(lambda b, out: (out.mean(), {}), batch)

    def plain() -> None:
        zero_grad_buffers(actor)  # also waits for the last pass's overlapped gradient all-reduce
        get_forward_backward_func()(
            forward_step_func=plain_forward_step, data_iterator=iter(batches), model=actor.chunks[0],
            num_microbatches=micro_batches, seq_length=seq, micro_batch_size=micro_batch, forward_only=False,
        )  # fmt: skip

    _, m_plain = measure(plain, 1)  # peak memory of each, after a warm-up call
    _, m_ours = measure(ours, 1)
    rounds = [(seconds(plain), seconds(ours)) for _ in range(repeats)]
    t_plain, t_ours = (statistics.median(times) for times in zip(*rounds, strict=True))
    print(f"actor forward+backward, {tokens} tokens, {shape.num_layers}×{shape.hidden_size}, vocab {shape.vocab_size}")
    print("TP=1, 1 thread")
    print(f"  plain Megatron (cross-entropy) : {t_plain * 1e3:8.1f} ms   peak +{m_plain:7.1f} MiB")
    print(f"  megatron-ppo (PPO loss)        : {t_ours * 1e3:8.1f} ms   peak +{m_ours:7.1f} MiB")
    ratio_time = statistics.median(ours / plain for plain, ours in rounds)
    ratio_memory = m_ours / max(m_plain, 1e-9)
    print(f"  overhead ratio ours/plain      : time {ratio_time:.2f}   peak memory {ratio_memory:.2f}")
    destroy_distributed()


if __name__ == "__main__":
    main()
