"""The megatron-core version bends hold on any device, not only on CPU."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from megatron_ppo.parallel.megatron_compat import bind_missing_te_general_gemm


def test_router_gemm_name_is_bound_without_transformer_engine_on_a_cuda_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node without Transformer Engine
    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)  # megatron-core 0.16.1 without TE
    bind_missing_te_general_gemm()
    assert moe_utils.te_general_gemm is None, "the MoE router's forward reads te_general_gemm (None: torch GEMM)"
