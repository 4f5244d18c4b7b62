"""Spawned-rank code for the SDPA core-attention parity test: ours against Megatron's `DotProductAttention`."""

from __future__ import annotations

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.models.attention import SDPAttention
from megatron_ppo.parallel import init_distributed

SEQ, BATCH, HEADS, GROUPS, HEAD_DIM = 7, 3, 4, 2, 8


def masks(kind: str) -> torch.Tensor | None:
    """None (causal by mask type), or Megatron's boolean mask [b, 1, s, s] (True = not allowed): causal plus
    left padding of 0, 2 and 3 tokens in the three rows (padded keys hidden from every query)."""
    if kind == "causal":
        return None
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
    padded = torch.arange(SEQ)[None, :] < torch.tensor([0, 2, 3])[:, None]  # [b, s_k]
    return causal[None, None] | padded[:, None, None, :]


def compare_with_dot_product_attention(rank: int, world_size: int, cases: list[tuple[str, int]]) -> dict:
    """The largest differences for each (mask kind, query groups) case, in one process."""
    init_distributed(MegatronConfig(), seed=0)
    return {case: _compare(*case) for case in cases}


def _compare(kind: str, groups: int) -> dict[str, float]:
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS, num_query_groups=groups,
        attention_dropout=0.0, hidden_dropout=0.0, params_dtype=torch.float32, attention_softmax_in_fp32=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    query = torch.randn(SEQ, BATCH, HEADS, HEAD_DIM, generator=gen)
    key, value = (torch.randn(SEQ, BATCH, groups, HEAD_DIM, generator=gen) for _ in range(2))
    weights = torch.randn(SEQ, BATCH, HEADS * HEAD_DIM, generator=gen)
    mask = masks(kind)
    if mask is not None:  # query rows with no allowed key carry no loss (their output is undefined)
        weights *= (~mask).any(-1)[:, 0].T[..., None]
    results = {}
    for name, cls in (("megatron", DotProductAttention), ("sdpa", SDPAttention)):
        module = cls(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
        inputs = [t.clone().requires_grad_(True) for t in (query, key, value)]
        out = module(*inputs, mask, attn_mask_type=AttnMaskType.causal)
        (out * weights).sum().backward()
        live = weights != 0
        results[name] = (out * live, [t.grad for t in inputs])
    (out_m, grads_m), (out_s, grads_s) = results["megatron"], results["sdpa"]
    return {
        "forward": float((out_m - out_s).abs().max()),
        **{f"grad_{n}": float((a - b).abs().max()) for n, a, b in zip("qkv", grads_m, grads_s, strict=True)},
        "output_scale": float(out_m.abs().max()),
    }


SDPA_OPS = {"aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
            "aten::_scaled_dot_product_attention_math": "math",
            "aten::_scaled_dot_product_efficient_attention": "memory-efficient",
            "aten::_scaled_dot_product_flash_attention": "flash",
            "aten::_scaled_dot_product_cudnn_attention": "cuDNN"}  # fmt: skip


def attention_kernel_of_a_training_step(rank: int, world_size: int, bucket: int | None) -> dict[str, object]:
    """The SDPA kernel an actor forward-backward of the tiny recipe's shape (bf16, micro-batches of its size, rows
    of its longest length; widths rounded up to `bucket`, the CUDA one forced by its setting) runs, read from the
    profiler's op names, beside the one `sdpa_backend` names for the run's start line."""
    from megatron_ppo.config import load_config
    from megatron_ppo.models import build_role_model, run_micro_batches
    from megatron_ppo.models.kernels import sdpa_backend

    overrides = ["model.params_dtype=bf16", "actor.megatron.tensor_model_parallel_size=1", "cluster.gpus_per_node=1",
                 *(f"{role}.megatron.tensor_model_parallel_size=1" for role in ("ref", "critic")),
                 *([f"actor.megatron.make_sequence_length_divisible_by={bucket}"] if bucket else [])]  # fmt: skip
    config = load_config("recipes/tiny-cpu.yaml", overrides)
    init_distributed(config.actor.megatron, seed=0)
    actor = build_role_model("actor", config.model, config.actor.megatron)
    rows, width = config.actor.ppo_micro_batch_size_per_gpu, config.data.max_prompt_length + 5
    ids = torch.randint(1, config.model.vocab_size, (rows, width), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run_micro_batches(actor, [{"input_ids": ids}], lambda batch, logits: (logits.float().mean(), {}),
                          forward_only=False)  # fmt: skip
    ran = sorted({SDPA_OPS[event.name] for event in profile.events() if event.name in SDPA_OPS})
    return {"ran": ran, "named": sdpa_backend(config), "padded": actor.padding.padded // rows}
