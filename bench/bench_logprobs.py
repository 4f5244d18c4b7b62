"""Vocabulary-parallel log-probs + entropy against gather-then-log_softmax, forward and backward, at TP=2.

Run: torchrun --nproc_per_node 2 -m bench.bench_logprobs   (or `make bench`)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from bench.common import measure, smallest
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models import vocab_parallel_log_probs
from megatron_ppo.parallel import destroy_distributed, init_distributed

SIZES = {"full": (2048, 32768, 5), "smallest": (64, 512, 1)}  # tokens, vocabulary, timed repeats


def main(argv: Sequence[str] | None = None) -> None:
    tokens, vocab, repeats = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    torch.set_num_threads(1)
    init_distributed(MegatronConfig(tensor_model_parallel_size=2), seed=0)
    rank = parallel_state.get_tensor_model_parallel_rank()
    local_vocab = vocab // 2
    gen = torch.Generator().manual_seed(rank)
    local_logits = torch.randn(1, tokens, local_vocab, generator=gen).requires_grad_(True)
    labels = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0))

    def ours() -> None:
        log_prob, entropy = vocab_parallel_log_probs(local_logits, labels, with_entropy=True)
        (log_prob.sum() + entropy.sum()).backward()
        local_logits.grad = None

    def gathered() -> None:
        full = gather_from_tensor_model_parallel_region(local_logits)  # [1, T, V] on every rank
        log_softmax = F.log_softmax(full.float(), dim=-1)
        log_prob = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        (log_prob.sum() + entropy.sum()).backward()
        local_logits.grad = None

    results = {}
    for name, fn in (("gather+log_softmax", gathered), ("vocab-parallel", ours)):
        dist.barrier()
        results[name] = measure(fn, repeats)
    if dist.get_rank() == 0:
        (t_base, m_base), (t_ours, m_ours) = results["gather+log_softmax"], results["vocab-parallel"]
        print(f"log-probs + entropy, fwd+bwd, {tokens} tokens × {vocab} vocab, TP=2 (rank 0, 1 thread per rank)")
        print(f"  gather+log_softmax : {t_base * 1e3:8.1f} ms   peak +{m_base:7.1f} MiB")
        print(f"  vocab-parallel     : {t_ours * 1e3:8.1f} ms   peak +{m_ours:7.1f} MiB")
        print(f"  ratio ours/baseline: time {t_ours / t_base:.2f}   peak memory {m_ours / max(m_base, 1e-9):.2f}")
    destroy_distributed()


if __name__ == "__main__":
    main()
