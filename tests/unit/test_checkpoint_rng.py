"""A checkpoint's RNG file restores the host generator and Megatron's tracked (tensor-parallel) streams exactly."""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel

from megatron_ppo.checkpoint.store import rng_states, set_rng_states
from megatron_ppo.parallel.cpu_compat import seed_model_parallel_rng


def _draws() -> tuple[torch.Tensor, torch.Tensor]:
    with tensor_parallel.get_cuda_rng_tracker().fork():  # the model-parallel stream (dropout, TP init)
        tracked = torch.rand(4)
    return torch.rand(4), tracked


def test_rng_states_resume_host_and_tracked_streams(tmp_path) -> None:
    seed_model_parallel_rng(123, tp_rank=1)
    _draws()
    torch.save(rng_states(), tmp_path / "rng_rank0.pt")
    expected = _draws()
    seed_model_parallel_rng(999, tp_rank=0)  # a fresh process would seed differently
    torch.manual_seed(5)
    set_rng_states(torch.load(tmp_path / "rng_rank0.pt", weights_only=True))
    host, tracked = _draws()
    assert torch.equal(host, expected[0]), "host generator not restored"
    assert torch.equal(tracked, expected[1]), "Megatron's tracked model-parallel RNG stream not restored"
