"""Log-probs + entropy, forward and backward, from bf16 logits against the token chunk size (`model.
logprob_chunk_tokens`): the peak memory above the logits is two float32 chunks, not two float32 copies of them.

Run: torchrun --nproc_per_node 1 -m bench.bench_logprob_chunks   (or `make bench`)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bench.common import measure, smallest
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models import vocab_parallel_log_probs
from megatron_ppo.parallel import destroy_distributed, init_distributed

# tokens, vocabulary, timed repeats, the chunk sizes compared (None: one chunk)
SIZES = {"full": (4096, 32768, 3, (None, 2048, 512, 128)), "smallest": (64, 512, 1, (None, 16))}


def main(argv: Sequence[str] | None = None) -> None:
    tokens, vocab, repeats, chunks = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    torch.set_num_threads(1)
    init_distributed(MegatronConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, tokens, vocab, generator=gen).bfloat16().requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=gen)
    logits_mib = logits.numel() * logits.element_size() / 2**20
    fp32_chunk_mib = vocab * 4 / 2**20  # per token

    def step(chunk: int | None) -> None:
        log_prob, entropy = vocab_parallel_log_probs(logits, labels, with_entropy=True, chunk_tokens=chunk)
        (log_prob.sum() + entropy.sum()).backward()
        logits.grad = None

    print(f"log-probs + entropy, fwd+bwd, {tokens} tokens × {vocab} vocab, bf16 logits ({logits_mib:.0f} MiB), "
          "1 thread")  # fmt: skip
    print(f"  {'chunk tokens':>12} {'time ms':>9} {'peak MiB':>9} {'2 fp32 chunks + bf16 grad, MiB':>31}")
    for chunk in chunks:
        seconds, peak = measure(lambda chunk=chunk: step(chunk), repeats)
        expected = 2 * (chunk or tokens) * fp32_chunk_mib + logits_mib
        print(f"  {chunk or 'all':>12} {seconds * 1e3:9.1f} {peak:9.1f} {expected:31.1f}")
    destroy_distributed()


if __name__ == "__main__":
    main()
