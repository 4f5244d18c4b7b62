"""Packed sequences (`models.packing`): the pack layout (whole sequences, padded to the layout's multiple, position
ids and cu_seqlens restarting per sequence), token-budget packing that never splits a sequence, and our SDPA core
attention on a pack against the same rows attended one by one."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType

from megatron_ppo.data.batching import packed_micro_batches
from megatron_ppo.models.attention import SDPAttention
from megatron_ppo.models.packing import PACK, HostPackedSeqParams, build_pack, labels_of, packed_width, per_row


def test_a_pack_holds_whole_sequences_each_padded_to_the_multiple() -> None:
    pack = build_pack([5, 2, 7], row_width=7, multiple=2, width=18)
    assert pack.segments == [6, 2, 10]  # 6 + 2 + 8, the last segment takes the tail of 2
    assert pack.params.qkv_format == "thd"
    assert pack.params.cu_seqlens_q.tolist() == [0, 5, 7, 14]
    assert pack.params.cu_seqlens_q_padded.tolist() == [0, 6, 8, 18]
    assert pack.params.cu_seqlens_kv_padded.tolist() == pack.params.cu_seqlens_q_padded.tolist()
    assert pack.params.max_seqlen_q == pack.params.max_seqlen_kv == 10
    # positions restart at each sequence; padding (a sequence's to the multiple, the tail) sits at 0, inside any
    # position table whatever the pass's width
    assert pack.position_ids[0].tolist() == [*range(5), 0, *range(2), *range(7), 0, 0, 0]
    assert pack.token_is_real[0].tolist() == [True] * 5 + [False] + [True] * 2 + [True] * 7 + [False] * 3
    assert pack.params.segment_bounds == (0, 6, 8, 18)  # the host copy our SDPA cuts by (no device read)
    # Transformer Engine: padding between sequences is said (no torch.equal of device tensors to infer it) ...
    assert getattr(pack.params, "pad_between_seqs", True) is True
    # ... and a pack without any is described by one cu_seqlens tensor, which TE reads as "no padding"
    tight = build_pack([5, 2, 7], row_width=7, multiple=1)
    assert tight.params.cu_seqlens_q_padded is tight.params.cu_seqlens_q is tight.params.cu_seqlens_kv_padded
    assert (
        tight.params.cu_seqlens_q.tolist() == [0, 5, 7, 14]
        and getattr(tight.params, "pad_between_seqs", False) is False
    )
    tail = build_pack([5, 2, 7], row_width=7, multiple=1, width=16)  # the pass's shape adds a tail: padding
    assert tail.params.cu_seqlens_q.tolist() == [0, 5, 7, 14] and tail.params.cu_seqlens_q_padded.tolist() == [
        0,
        5,
        7,
        16,
    ]
    with pytest.raises(ValueError, match="cannot fill"):
        build_pack([5, 2, 7], row_width=7, multiple=2, width=17)
    assert packed_width([5, 2, 7], multiple=2, bucket=4) == 16


def test_pack_and_unpack_are_inverse_on_real_tokens_and_zero_elsewhere() -> None:
    lengths = [3, 6, 1]
    rows = torch.arange(1, 19).reshape(3, 6) * (torch.arange(6)[None] < torch.tensor(lengths)[:, None])
    pack = build_pack(lengths, row_width=6, multiple=4)
    packed = pack.pack(rows)
    assert packed.shape == (1, 16) and packed[0].tolist() == [1, 2, 3, 0, 7, 8, 9, 10, 11, 12, 0, 0, 13, 0, 0, 0]
    assert torch.equal(pack.unpack(packed), rows)
    features = torch.randn(1, 16, 3, requires_grad=True)
    back = per_row({PACK: pack}, features)
    back.sum().backward()
    assert back.shape == (3, 6, 3) and torch.equal(features.grad[0, :, 0], pack.token_is_real[0].float())
    batch = {"labels": rows}
    assert labels_of(batch) is rows and per_row(batch, rows) is rows  # unpacked micro-batches: as they are
    assert torch.equal(labels_of({**batch, PACK: pack}), packed)


@pytest.mark.parametrize("seed", range(5))
def test_packed_budgets_never_split_a_sequence_and_hold_the_budget(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(37)]
    packs = packed_micro_batches(lengths, max_tokens=64)
    assert sorted(i for pack in packs for i in pack) == list(range(37))  # every sequence once, whole
    assert all(sum(lengths[i] for i in pack) <= 64 for pack in packs)
    assert len(packs) <= -(-sum(lengths) // 64) + 2  # first-fit decreasing: near the bound
    more = packed_micro_batches(lengths, max_tokens=64, count=len(packs) + 3)
    assert len(more) == len(packs) + 3 and sorted(i for pack in more for i in pack) == list(range(37))
    with pytest.raises(ValueError, match="more than the micro-batch budget"):
        packed_micro_batches([10, 70], max_tokens=64)


@pytest.mark.parametrize("groups", [4, 2])
def test_sdpa_attends_within_each_packed_sequence_as_it_does_per_row(groups: int) -> None:
    heads, head_dim, lengths = 4, 8, [5, 1, 7, 3]
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0, params_dtype=torch.float32)  # fmt: skip
    one_rank = SimpleNamespace(tp=SimpleNamespace(size=lambda: 1))
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=one_rank)
    pack = build_pack(lengths, row_width=7, multiple=2, width=20)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(20, heads, head_dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(20, groups, head_dim, generator=gen, requires_grad=True) for _ in range(2))
    out = attention(q, k, v, None, packed_seq_params=pack.params)
    assert out.shape == (20, heads * head_dim)
    host_only = HostPackedSeqParams(qkv_format="thd", segment_bounds=pack.params.segment_bounds)  # no device tensors
    assert torch.equal(attention(q, k, v, None, packed_seq_params=host_only), out)
    weights = torch.randn(out.shape, generator=gen) * pack.token_is_real[0, :, None]
    (out * weights).sum().backward()
    starts = pack.params.cu_seqlens_q_padded.tolist()
    for start, length in zip(starts, lengths, strict=False):
        piece = slice(start, start + length)
        rows = [t[piece].detach().unsqueeze(1).requires_grad_(True) for t in (q, k, v)]  # [s, 1, h, d]
        expected = attention(*rows, None)[:, 0]
        torch.testing.assert_close(out[piece], expected, rtol=0, atol=1e-6)
        (expected * weights[piece]).sum().backward()
        for packed, row in zip((q, k, v), rows, strict=True):
            torch.testing.assert_close(packed.grad[piece], row.grad[:, 0], rtol=0, atol=1e-6)
