"""Part (j) of the GPU check: packed attention without Transformer Engine. A pack of four sequences (700, 300, 24
and 1000 tokens) at the (b) shape's heads (12 query heads, 2 key/value groups, head size 128, bf16) through
`SDPAttention`'s two packed paths: one causal `torch.nn.attention.varlen.varlen_attn` call over the whole pack (what
`packed_attention_path` chooses on this GPU) and one SDPA call per sequence (the reference). Gates: the varlen path
is the one chosen here; outputs and q/k/v gradients of the real tokens agree within bf16 rounding (relative to each
tensor's largest magnitude: 2⁻⁶); the varlen forward and backward run with CUDA's sync debug mode set to raise (no
host read). Reported: each path's forward + backward time and their ratio. The dry run (CPU, where torch has no
varlen kernel) checks that the per-sequence path is chosen there and runs it."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from gpu_check.plan import Plan
from gpu_check.sizing import START_S, Sized

LENGTHS = (700, 300, 24, 1000)
HEADS, GROUPS, HEAD_DIM = 12, 2, 128
TOLERANCE = 2.0**-6
REPEATS = 10


def size(plan: Plan) -> Sized:
    """(j) on `plan.card`: one attention layer's q, k, v and their gradients over the pack (megabytes), the planner's
    reservation for the process."""
    from megatron_ppo.planner.plan import RESERVED_GIB

    return Sized(None, RESERVED_GIB, True, fixed_s=START_S + 5.0)


def _module():
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_ppo.models.attention import SDPAttention

    config = TransformerConfig(num_layers=1, hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, attention_dropout=0.0, params_dtype=torch.bfloat16)  # fmt: skip
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    return SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)


def _run(call, q, k, v, weights) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for t in (q, k, v):
        t.grad = None
    out = call()
    (out.float() * weights).sum().backward()
    return out.detach(), [t.grad.detach().clone() for t in (q, k, v)]


def _seconds(call, q, k, v, weights) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(REPEATS):
        _run(call, q, k, v, weights)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) / REPEATS


def check_packed_attention(plan: Plan, work: Path) -> dict[str, Any]:
    from megatron_ppo.models.attention import PER_SEQUENCE, VARLEN, packed_attention_path
    from megatron_ppo.models.packing import build_pack
    from megatron_ppo.parallel.device import current_device

    device = current_device()
    dtype = torch.bfloat16
    module = _module().to(device)
    path = packed_attention_path(device, dtype, HEAD_DIM, module.softmax_scale, True, 0.0)
    if plan.device == "cpu":
        return {"path": path, "ok": path == PER_SEQUENCE, "note": "no varlen kernel on the CPU"}
    pack = build_pack(LENGTHS, row_width=max(LENGTHS), multiple=1, device=device)
    width = sum(LENGTHS)
    gen = torch.Generator(device).manual_seed(0)
    q = torch.randn(width, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(width, GROUPS, HEAD_DIM, generator=gen, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    weights = torch.randn(width, HEADS * HEAD_DIM, generator=gen, device=device)
    varlen = lambda: module._varlen(q, k, v, pack.params, True)  # noqa: E731
    per_sequence = lambda: module._per_sequence(q, k, v, pack.params, 0.0, True)  # noqa: E731
    torch.cuda.set_sync_debug_mode("error")  # a host read inside the varlen call raises
    try:
        ours, our_grads = _run(varlen, q, k, v, weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference, reference_grads = _run(per_sequence, q, k, v, weights)
    differences = {
        name: float((a.float() - b.float()).abs().max() / b.float().abs().max())
        for name, a, b in zip(("out", "dq", "dk", "dv"), (ours, *our_grads), (reference, *reference_grads),
                              strict=True)
    }  # fmt: skip
    varlen_s, per_sequence_s = _seconds(varlen, q, k, v, weights), _seconds(per_sequence, q, k, v, weights)
    return {"path": path, "relative_differences": differences, "tolerance": TOLERANCE, "varlen_ms": varlen_s * 1e3,
            "per_sequence_ms": per_sequence_s * 1e3, "speedup": per_sequence_s / varlen_s, "lengths": LENGTHS,
            "ok": path == VARLEN and max(differences.values()) <= TOLERANCE}  # fmt: skip


def table_lines(j: dict[str, Any]) -> list[str]:
    if "path" not in j:
        return [f"(j) packed attention without TE      FAILED {j.get('error', '')[:300]}"]
    if "relative_differences" not in j:
        return [f"(j) packed attention without TE      {'ok' if j['ok'] else 'FAILED'}  path {j['path']} ({j['note']})"]
    worst = ", ".join(f"{name} {d:.1e}" for name, d in j["relative_differences"].items())
    return [f"(j) packed attention without TE      {'ok' if j['ok'] else 'FAILED'}  path {j['path']}; against one "
            f"SDPA call per sequence: max |Δ|/max|x| {worst} (≤ {j['tolerance']:.1e}); forward + backward "
            f"{j['varlen_ms']:.2f} vs {j['per_sequence_ms']:.2f} ms ({j['speedup']:.1f}×); no host read"]  # fmt: skip
