"""The packed attention path (`models.attention.packed_attention_path`): torch's variable-length flash kernel
(`varlen_attn`, one call per layer) only where it runs — CUDA, a torch that has it, half precision, a head size the
kernel takes, no dropout — else one SDPA call per sequence; the call made for each of torch's varlen signatures;
and, with a stand-in that computes what torch documents `varlen_attn` to compute (the kernel has no CPU
implementation), the one call equal to the per-sequence path, forward and backward, grouped heads as they are."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_ppo.models import attention
from megatron_ppo.models.attention import (
    PER_SEQUENCE,
    VARLEN,
    SDPAttention,
    packed_attention_path,
    torch_varlen_attn,
    varlen_causal_keywords,
)
from megatron_ppo.models.packing import build_pack

CUDA = torch.device("cuda", 0)
H200 = (9, 0)


def varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    raise AssertionError("signature only")


def varlen_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1)):  # fmt: skip
    raise AssertionError("signature only")


class DocumentedVarlen:
    """torch 2.12–2.13's `varlen_attn` signature, computing what its documentation says (attention inside each
    [cu_seq_q[i], cu_seq_q[i + 1]), causal for window_size (-1, 0), key/value heads shared by consecutive query heads
    under enable_gqa) with a dense mask; each call recorded."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                 window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None,
                 num_splits=None):  # fmt: skip
        self.calls.append(dict(query=query, key=key, value=value, cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q,
                               max_k=max_k, scale=scale, window_size=window_size, enable_gqa=enable_gqa))  # fmt: skip
        sizes = cu_seq_q.diff().long()
        assert int(sizes.max()) <= max_q and torch.equal(cu_seq_q, cu_seq_k)
        segment = torch.repeat_interleave(torch.arange(len(sizes)), sizes)
        position = torch.arange(query.shape[0])
        allowed = segment[:, None] == segment[None, :]
        if tuple(window_size) == (-1, 0):
            allowed &= position[None, :] <= position[:, None]
        out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (query, key, value)), attn_mask=allowed,
                                             scale=scale, enable_gqa=enable_gqa)  # fmt: skip
        return out[0].transpose(0, 1)


def test_the_varlen_path_is_chosen_only_where_torch_varlen_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    bf16, scale = torch.bfloat16, 128**-0.5
    choose = lambda **change: packed_attention_path(  # noqa: E731
        **{"device": CUDA, "dtype": bf16, "head_dim": 128, "scale": scale, "grouped": True, "dropout": 0.0,
           "capability": H200, "function": torch_varlen_attn(), **change})  # fmt: skip
    assert packed_attention_path(torch.device("cpu"), bf16, 128, scale, True, 0.0) == PER_SEQUENCE  # this machine
    if torch_varlen_attn() is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    assert choose() == VARLEN  # an H200 with this torch
    assert choose(dtype=torch.float16) == VARLEN
    refused = {
        "the CPU": {"device": torch.device("cpu")},
        "fp32": {"dtype": torch.float32},
        "dropout": {"dropout": 0.1},
        "head size 12": {"head_dim": 12},
        "head size 320": {"head_dim": 320},
        "a V100": {"capability": (7, 0)},
        "2.10 at a scale other than 1/√d": {"function": varlen_2_10, "scale": 0.5},
    }
    for why, change in refused.items():
        assert choose(**change) == PER_SEQUENCE, f"{why}: chose the varlen path"
    assert choose(function=varlen_2_10) == choose(function=varlen_2_11) == VARLEN
    monkeypatch.setattr(attention, "torch_varlen_attn", lambda: None)  # torch < 2.10
    assert choose(function=None) == PER_SEQUENCE, "torch < 2.10: chose the varlen path"
    monkeypatch.undo()
    monkeypatch.setattr(torch.backends.cuda, "flash_sdp_enabled", lambda: False)  # the user turned flash off
    assert choose() == PER_SEQUENCE


def test_the_causal_varlen_call_follows_each_torch_signature() -> None:
    scale = 64**-0.5
    assert varlen_causal_keywords(varlen_2_10, scale, 64, True) == {"is_causal": True}  # GQA native, default scale
    assert varlen_causal_keywords(varlen_2_10, 0.1, 64, False) is None
    assert varlen_causal_keywords(varlen_2_11, 0.1, 64, True) == {"window_size": (-1, 0), "scale": 0.1}
    documented = DocumentedVarlen()
    expected = {"window_size": (-1, 0), "scale": 0.1, "enable_gqa": True}
    assert varlen_causal_keywords(documented.__call__, 0.1, 64, True) == expected
    if torch_varlen_attn() is not None:  # the torch installed (2.13 in the lock)
        assert varlen_causal_keywords(torch_varlen_attn(), 0.1, 64, True) in (
            None,
            expected,
            {k: expected[k] for k in expected if k != "enable_gqa"},
        )


@pytest.mark.parametrize("groups", [4, 2])
def test_a_pack_runs_as_one_causal_varlen_call_equal_to_the_per_sequence_path(
    groups: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    heads, head_dim, lengths = 4, 8, [5, 1, 7, 3]
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0, params_dtype=torch.float32)  # fmt: skip
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    module = SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)
    pack = build_pack(lengths, row_width=7, multiple=2, width=20)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, heads, head_dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(20, groups, head_dim, generator=gen, requires_grad=True) for _ in range(2))
    weights = torch.randn(20, heads * head_dim, generator=gen) * pack.token_is_real[0, :, None]

    def run(path: str) -> tuple[torch.Tensor, list[torch.Tensor]]:  # the path forced through SDPAttention's choice
        monkeypatch.setattr(attention, "packed_attention_path", lambda *_: path)
        for t in (q, k, v):
            t.grad = None
        out = module(q, k, v, None, packed_seq_params=pack.params)
        (out * weights).sum().backward()
        return out, [t.grad.clone() for t in (q, k, v)]

    documented = DocumentedVarlen()
    monkeypatch.setattr(attention, "torch_varlen_attn", lambda: documented)
    (varlen, varlen_grads), (per_sequence, per_sequence_grads) = run(VARLEN), run(PER_SEQUENCE)
    assert len(documented.calls) == 1, "one varlen call for the whole pack"
    (call,) = documented.calls
    assert call["query"] is q and call["key"] is k and call["value"] is v, "q, k, v as they come (no copy, no repeat)"
    assert call["cu_seq_q"] is pack.params.cu_seqlens_q_padded and call["cu_seq_k"] is pack.params.cu_seqlens_kv_padded
    assert call["cu_seq_q"].dtype == torch.int32
    assert (call["max_q"], call["max_k"]) == (8, 8) and all(type(call[m]) is int for m in ("max_q", "max_k"))
    assert (call["window_size"], call["scale"], call["enable_gqa"]) == ((-1, 0), head_dim**-0.5, groups != heads)
    real = pack.token_is_real[0]
    torch.testing.assert_close(varlen[real], per_sequence[real], rtol=0, atol=1e-6)
    for name, a, b in zip("qkv", varlen_grads, per_sequence_grads, strict=True):
        differ = (a - b).abs().amax((1, 2))
        assert differ.max() < 1e-5, f"the gradient of {name} differs from the per-sequence path's by {differ.tolist()}"
