"""RoPE on a pack (`parallel.megatron_compat.rotary_per_token`): the whole pack rotated at once from per-token angles
`freqs[position_ids]` equals Megatron's THD RoPE (`rope_utils._apply_rotary_pos_emb_thd`, reached through
`apply_rotary_pos_emb` with cu_seqlens), bit for bit, on the release installed (0.16.1's concatenates each sequence's
angles and rotates once, 0.19's rotates sequence by sequence)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer import TransformerConfig

from megatron_ppo.models.packing import build_pack
from megatron_ppo.parallel.megatron_compat import apply_rotary_pos_emb_whole_pack

ONE_RANK = SimpleNamespace(size=lambda: 1, rank=lambda: 0)  # the context-parallel group without CP


def _angles(head_dim: int, interleaved: bool, length: int, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """Megatron's own angle table `[length, 1, 1, head_dim]` (its `get_emb` moves `inv_freq` to the current CUDA
    device: the host here)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    rotary = RotaryEmbedding(kv_channels=head_dim, rotary_percent=1.0, rotary_interleaved=interleaved,
                             use_cpu_initialization=True)  # fmt: skip
    return rotary.get_emb(length)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    ("head_dim", "lengths", "multiple", "width"),
    [(8, [5, 1, 7, 3], 2, 20), (64, [37, 120, 9, 64, 1], 1, None), (128, [250, 3, 31], 4, 300)],
)
def test_whole_pack_rope_equals_megatron_thd_rope_bit_for_bit(
    head_dim: int, lengths: list[int], multiple: int, width: int | None, interleaved: bool, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    pack = build_pack(lengths, row_width=max(lengths), multiple=multiple, width=width)
    config = TransformerConfig(num_layers=1, hidden_size=4 * head_dim, num_attention_heads=4,
                               rotary_interleaved=interleaved, apply_rope_fusion=False)  # fmt: skip
    table = _angles(head_dim, interleaved, pack.params.max_seqlen_q, monkeypatch)
    t = torch.randn(pack.width, 3, head_dim, generator=torch.Generator().manual_seed(len(lengths))).to(dtype)
    megatron = rope_utils.apply_rotary_pos_emb(t, table, config, cu_seqlens=pack.params.cu_seqlens_q_padded,
                                               cp_group=ONE_RANK)  # fmt: skip
    per_token = table.index_select(0, pack.position_ids[0])  # what rotary_per_token hands every layer
    ours = apply_rotary_pos_emb_whole_pack(t, per_token, config, cu_seqlens=pack.params.cu_seqlens_q_padded,
                                           cp_group=ONE_RANK)  # fmt: skip
    real = pack.token_is_real[0]  # padding positions are 0 in a pack (any angle: no real token attends to them)
    assert ours.shape == megatron.shape == t.shape
    differ = (ours != megatron)[real].any(-1).any(-1).nonzero().flatten().tolist()
    assert not differ, f"the whole-pack rotation differs from Megatron's THD RoPE at real pack positions {differ}"
    assert not torch.equal(ours, t), "nothing was rotated"


def test_a_call_that_is_not_a_whole_pack_is_megatrons() -> None:
    """Angles of the longest sequence (Megatron's THD table), or no cu_seqlens: Megatron's own function runs."""
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, apply_rope_fusion=False)
    pack = build_pack([3, 4], row_width=4, multiple=1)
    t = torch.randn(7, 2, 8)
    table = torch.rand(4, 1, 1, 8)
    thd = rope_utils.apply_rotary_pos_emb(t, table, config, cu_seqlens=pack.params.cu_seqlens_q, cp_group=ONE_RANK)
    ours = apply_rotary_pos_emb_whole_pack(t, table, config, cu_seqlens=pack.params.cu_seqlens_q, cp_group=ONE_RANK)
    assert torch.equal(ours, thd)
    rows = torch.randn(4, 2, 2, 8)  # [s, b, heads, d]: no pack
    assert torch.equal(apply_rotary_pos_emb_whole_pack(rows, table, config, cp_group=ONE_RANK),
                       rope_utils.apply_rotary_pos_emb(rows, table, config, cp_group=ONE_RANK))  # fmt: skip
