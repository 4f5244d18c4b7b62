"""The actor's PPO update step (forward-backward with the PPO loss through Megatron's schedule, then Adam) on the tiny
recipe's shape, LoRA (rank 8 on QKV, attention output, FC1, FC2) against the full fine-tune, side by side: step time
and memory — the peak resident memory the step adds, and the training state counted tensor by tensor (weights,
gradient buffers, Adam's states and main weights). LoRA runs first, in a fresh process's memory.

Run: torchrun --nproc_per_node 1 -m bench.bench_lora_step   (or `make bench`)
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Sequence

import torch

from bench.common import current_rss_mib, peak_rss_mib, reset_peak_rss, smallest
from megatron_ppo import algo
from megatron_ppo.config.schema import LoraSettings, MegatronConfig, ModelConfig, OptimConfig
from megatron_ppo.models import build_role_model, run_micro_batches, vocab_parallel_log_probs
from megatron_ppo.parallel import destroy_distributed, init_distributed
from megatron_ppo.train.optimizer import build_optimizer, optimizer_step, zero_grads

# the tiny recipe's actor (recipes/tiny-cpu.yaml) at a 1024-wide hidden size, where the optimizer's states show
MODEL = ModelConfig(
    num_layers=2, hidden_size=1024, num_attention_heads=8, vocab_size=256, max_position_embeddings=64,
    params_dtype="fp32", normalization="LayerNorm", activation="gelu", add_bias_linear=True,
)  # fmt: skip
SMALLEST_MODEL = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                             max_position_embeddings=16, params_dtype="fp32")  # fmt: skip
# the model, micro-batches, rows per micro-batch, sequence length, timed steps
SIZES = {"full": (MODEL, 2, 16, 32, 5), "smallest": (SMALLEST_MODEL, 1, 2, 8, 1)}
LORA = LoraSettings(rank=8, alpha=16.0)


def _state_mib(actor, optimizer) -> dict[str, float]:
    """MiB of the weights, of the DDP gradient buffers (trained parameters only) and of the optimizer's tensors."""
    weights = sum(p.numel() * p.element_size() for chunk in actor.chunks for p in chunk.parameters())
    grads = sum(buffer.grad_data.numel() * buffer.grad_data.element_size() for chunk in actor.chunks
                for buffer in chunk.buffers)  # fmt: skip
    held = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            held += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return {"weights": weights / 2**20, "grads": grads / 2**20, "optimizer": held / 2**20}


def _run(shape: ModelConfig, lora: LoraSettings | None, batches: list[dict], repeats: int) -> tuple[float, float, dict]:
    """(median step seconds, peak resident MiB added from before the model was built, the state's MiB)."""
    gc.collect()
    reset_peak_rss()
    base = current_rss_mib()
    actor = build_role_model("actor", shape, MegatronConfig(), lora=lora)
    optimizer = build_optimizer(actor, OptimConfig(lr=1e-4), MegatronConfig())
    tokens = sum(batch["mask"].numel() for batch in batches)

    def ppo_loss(batch, logits):
        log_prob, _ = vocab_parallel_log_probs(logits, batch["labels"])
        config = algo.PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.28,
                                       global_batch_info={"batch_num_tokens": tokens})  # fmt: skip
        return algo.get_policy_loss_fn("vanilla")(
            batch["old_log_prob"], log_prob, batch["advantages"], batch["mask"], "token-mean", config
        )

    def step() -> None:
        zero_grads(actor, optimizer)
        run_micro_batches(actor, batches, ppo_loss, forward_only=False)
        optimizer_step(optimizer, clip_grad=1.0)

    step()  # warm-up: Adam's states exist from the first step
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times), peak_rss_mib() - base, _state_mib(actor, optimizer)


def main(argv: Sequence[str] | None = None) -> None:
    shape, micro_batches, rows, seq, repeats = SIZES["smallest" if smallest(argv, __doc__) else "full"]
    torch.set_num_threads(1)
    init_distributed(MegatronConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(micro_batches):
        input_ids = torch.randint(0, shape.vocab_size, (rows, seq), generator=gen)
        batches.append({"input_ids": input_ids, "labels": torch.roll(input_ids, -1, 1), "mask": torch.ones(rows, seq),
                        "old_log_prob": -torch.rand(rows, seq, generator=gen) * 4,
                        "advantages": torch.randn(rows, seq, generator=gen)})  # fmt: skip
    results = {"LoRA r8": _run(shape, LORA, batches, repeats), "full": _run(shape, None, batches, repeats)}
    print(f"actor PPO update step (forward+backward+Adam), {micro_batches}×{rows}×{seq} tokens, "
          f"{shape.num_layers}×{shape.hidden_size}, TP=1, 1 thread")  # fmt: skip
    print(f"  {'':10}{'step ms':>10}{'peak +MiB':>11}{'weights':>10}{'grads':>9}{'optim':>9}  (state MiB)")
    for name, (seconds, peak, state) in results.items():
        print(f"  {name:10}{seconds * 1e3:10.1f}{peak:11.1f}{state['weights']:10.1f}{state['grads']:9.2f}"
              f"{state['optimizer']:9.2f}")  # fmt: skip
    (t_lora, _, s_lora), (t_full, _, s_full) = results.values()
    print(f"  LoRA / full: step time {t_lora / t_full:.2f}, gradients + optimizer "
          f"{(s_lora['grads'] + s_lora['optimizer']) / (s_full['grads'] + s_full['optimizer']):.3f}")  # fmt: skip
    destroy_distributed()


if __name__ == "__main__":
    main()
