"""Spawned-rank code for the vocabulary-parallel log-prob tests."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models import vocab_parallel_log_probs
from megatron_ppo.parallel import init_distributed

BATCH, SEQ, PADDED_VOCAB, VOCAB = 3, 5, 48, 45


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor (of `dtype`, if given) an operation produces."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.largest, self.dtype = 0, dtype

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and (self.dtype is None or tensor.dtype == self.dtype):
                self.largest = max(self.largest, tensor.numel())
        return out


def compare_with_full_softmax(
    rank: int, world_size: int, temperature: float, chunks: list[int | None]
) -> dict[int | None, dict[str, Any]]:
    """For each chunk size: the largest differences from a full-vocabulary log-softmax (float32 logits), and the
    largest float32 tensor built from bfloat16 logits (the memory above the logits)."""
    init_distributed(MegatronConfig(tensor_model_parallel_size=world_size), seed=0)
    gen = torch.Generator().manual_seed(3)
    full_logits = torch.randn(BATCH, SEQ, PADDED_VOCAB, generator=gen) * 4
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    weights = torch.rand(BATCH, SEQ, generator=gen)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    width = PADDED_VOCAB // world_size

    reference_logits = full_logits.clone().requires_grad_(True)
    log_softmax = F.log_softmax(reference_logits[..., :VOCAB] / temperature, dim=-1)
    ref_log_prob = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ((ref_log_prob + 0.3 * ref_entropy) * weights).sum().backward()
    ref_grad = reference_logits.grad[..., tp_rank * width : (tp_rank + 1) * width]

    reports: dict[int | None, dict[str, Any]] = {}
    for chunk in chunks:
        # float32 logits of their own (not a leaf, as a model's are): the backward writes the gradient into them
        local = full_logits[..., tp_rank * width : (tp_rank + 1) * width].clone().requires_grad_(True)
        with LargestTensor() as probe:
            log_prob, entropy = vocab_parallel_log_probs(
                local * 1.0, labels, vocab_size=VOCAB, temperature=temperature, with_entropy=True, chunk_tokens=chunk
            )
            ((log_prob + 0.3 * entropy) * weights).sum().backward()
        local_bf16 = local.detach().bfloat16().requires_grad_(True)
        with LargestTensor(torch.float32) as fp32_probe:
            log_prob_bf16, entropy_bf16 = vocab_parallel_log_probs(
                local_bf16, labels, vocab_size=VOCAB, temperature=temperature, with_entropy=True, chunk_tokens=chunk
            )
            ((log_prob_bf16 + 0.3 * entropy_bf16) * weights).sum().backward()
        reports[chunk] = {
            "log_prob": float((log_prob - ref_log_prob).abs().max()),
            "entropy": float((entropy - ref_entropy).abs().max()),
            "grad": float((local.grad - ref_grad).abs().max()),
            "largest_tensor": probe.largest,
            "largest_fp32_from_bf16": fp32_probe.largest,
            "bf16_grad_dtype": str(local_bf16.grad.dtype),
        }
    reports["full_vocab_tensor"] = BATCH * SEQ * PADDED_VOCAB  # type: ignore[index]
    reports["width"] = width  # type: ignore[index]
    return reports


class LogitsSizedTensors(TorchDispatchMode):
    """Counts the tensors of at least `numel` elements that operations create (new storage; views of an existing
    one are not counted)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.storages = numel, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, tuple | list) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.numel() >= self.numel:
                pointer = tensor.untyped_storage().data_ptr()
                if pointer not in inputs:
                    self.storages.add(pointer)
        return out


def logits_buffers_under_the_width_bucket(rank: int, world_size: int) -> dict[str, Any]:
    """One actor forward-backward through the schedule with every width rounded up to 128 (the CUDA bucket, forced
    by its setting): how many tensors the size of the logits of the micro-batch's real tokens `[tokens, vocab]` are
    created, and whether the logits' gradient is written into their own storage (`models.logprobs`)."""
    from megatron_ppo.config.schema import ModelConfig
    from megatron_ppo.models import build_role_model, run_micro_batches
    from megatron_ppo.models.widths import CUDA_WIDTH_BUCKET

    model_config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=32,
                               vocab_size=1024, max_position_embeddings=64, params_dtype="fp32")  # fmt: skip
    report: dict[str, Any] = {}
    init_distributed(MegatronConfig(), seed=0)
    for bucket in (None, CUDA_WIDTH_BUCKET):
        actor = build_role_model("actor", model_config, MegatronConfig(make_sequence_length_divisible_by=bucket))
        ids = torch.randint(1, 1000, (4, 40), generator=torch.Generator().manual_seed(0))
        pointers: dict[str, int] = {}

        def loss_fn(batch, logits, pointers=pointers):
            pointers["logits"] = logits.untyped_storage().data_ptr()
            logits.register_hook(lambda grad: pointers.__setitem__("grad", grad.untyped_storage().data_ptr()))
            log_probs, _ = vocab_parallel_log_probs(logits, batch["labels"], vocab_size=1000)
            return -log_probs.mean(), {}

        counter = LogitsSizedTensors(ids.numel() * actor.padded_vocab_size)
        with counter:
            run_micro_batches(actor, [{"input_ids": ids, "labels": torch.roll(ids, -1, 1)}], loss_fn,
                              forward_only=False)  # fmt: skip
        in_place = pointers["grad"] == pointers["logits"]
        report[str(bucket)] = {"logits_sized": len(counter.storages), "in_place": in_place,
                               "padded": actor.padding.padded}  # fmt: skip
    return report
