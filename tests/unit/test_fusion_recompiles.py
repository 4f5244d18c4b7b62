"""The fusions Megatron compiles on CUDA (`megatron.core.jit.jit_fuser`, `torch.compile` with its defaults:
`models.kernels`) do not compile again for each pack's width: the second width recompiles once with the token
dimension dynamic (torch's automatic dynamic shapes), every later width reuses that graph. Counted with Dynamo's
frame counter over the fusions' own functions (Dynamo's guards decide a recompile before any backend runs, so
the eager backend stands in for Inductor, which has no kernel to build on a CPU test)."""

from __future__ import annotations

import torch
import torch._dynamo
from megatron.core import jit
from megatron.core.fusions import fused_bias_gelu, fused_bias_swiglu
from torch._dynamo.testing import CompileCounter

from megatron_ppo.startup.deferred_compile import TORCH_COMPILE, compile_megatron_on_first_call


def test_the_compiled_fusions_compile_at_most_twice_over_many_pack_widths() -> None:
    # torch.compile, or the same deferred to the first call (`megatron_ppo.startup.deferred_compile`, when the package
    # was imported before Megatron)
    assert jit.jit_fuser in (TORCH_COMPILE, compile_megatron_on_first_call), "the fusions are no longer torch.compile"
    hidden = 16
    for name, fused, inputs in (
        ("bias_gelu", fused_bias_gelu.bias_gelu, lambda t: (torch.randn(hidden), torch.randn(t, 1, hidden))),
        (
            "bias_swiglu",
            fused_bias_swiglu.bias_swiglu,
            lambda t: (torch.randn(t, 1, 2 * hidden), torch.randn(2 * hidden)),
        ),
    ):
        torch._dynamo.reset()
        counter = CompileCounter()
        function = getattr(fused, "_torchdynamo_orig_callable", None) or fused.__wrapped__
        compiled = TORCH_COMPILE(function, backend=counter)  # jit_fuser's call, with the eager backend
        for width in (26, 40, 18, 64, 33, 26):  # one pack width per micro-batch
            compiled(*inputs(width))
        assert counter.frame_count <= 2, f"{name}: compiled {counter.frame_count} times over 5 pack widths"
