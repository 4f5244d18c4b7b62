"""`megatron_ppo.startup.deferred_compile`: Megatron-Core's `torch.compile` decorations set up at their first call — the
same compilation, with the same options, by dynamo itself (a counting backend here) — and not at import."""

from __future__ import annotations

import torch

from megatron_ppo.startup.deferred_compile import compile_megatron_on_first_call
from tests.support.fresh_process import assert_in_a_fresh_process


def _scaled_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 2.0 * x + y


def _counting_backend(compilations: list[int]):
    def backend(graph_module, example_inputs):
        compilations.append(len(example_inputs))
        return graph_module.forward

    return backend


def _function_of(module: str):
    def function(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _scaled_sum(x, y)

    function.__module__ = module
    return function


def test_a_function_of_megatrons_is_compiled_at_its_first_call_with_its_options() -> None:
    compilations: list[int] = []
    deferred = compile_megatron_on_first_call(backend=_counting_backend(compilations), dynamic=False)(
        _function_of("megatron.core.fusions.example")
    )
    assert compilations == [], "nothing is compiled before the first call"
    x, y = torch.arange(4.0), torch.ones(4)
    assert torch.equal(deferred(x, y), 2.0 * x + y)
    assert compilations == [2], "dynamo traced it once, with the two inputs"
    assert torch.equal(deferred(x, y), 2.0 * x + y) and compilations == [2], "the second call reuses the compilation"
    assert deferred.__name__ == "function" and deferred.__wrapped__.__module__ == "megatron.core.fusions.example"


def test_anything_else_goes_to_torch_compile_at_once() -> None:
    compilations: list[int] = []
    backend = _counting_backend(compilations)
    for other in (_function_of("my_package.model"), torch.nn.Linear(2, 2)):
        compiled = compile_megatron_on_first_call(other, backend=backend)
        assert hasattr(compiled, "_torchdynamo_orig_callable") or isinstance(compiled, torch.nn.Module), compiled
        assert compiled is not other


def test_importing_megatron_core_through_the_package_sets_up_no_compiler() -> None:
    """In a fresh process, as every launched rank starts: Megatron's decorated functions are the deferred wrappers,
    and neither inductor's compiler (`compile_fx`, its kernel templates: ~1.4 CPU-seconds) nor torch's varlen attention
    module (it imports dynamo's compiler; `models.attention` asks for it only on CUDA) is imported."""
    assert_in_a_fresh_process(
        "import sys, megatron_ppo.train.run, megatron.core.jit as jit, megatron.core.fusions.fused_bias_geglu as g",
        "from megatron_ppo.startup.deferred_compile import compile_megatron_on_first_call as deferred",
        "assert jit.jit_fuser is deferred, jit.jit_fuser",
        "assert g.geglu.__code__.co_name == 'compiled_at_first_call', g.geglu",
        "assert 'torch._inductor.compile_fx' not in sys.modules, 'inductor was imported'",
        "assert 'torch.nn.attention.varlen' not in sys.modules, 'varlen attention (and its dynamo) was imported'",
    )


def test_one_called_by_a_function_being_compiled_is_traced_inline() -> None:
    """Megatron's `bias_swiglu` calls its `swiglu`, both deferred: compiling the outer traces the inner into the same
    graph (one compilation, no break, the inner never compiled alone), as dynamo does with a compiled function."""
    outer_compilations: list[int] = []
    inner_compilations: list[int] = []
    inner = compile_megatron_on_first_call(backend=_counting_backend(inner_compilations))(
        _function_of("megatron.core.fusions.inner")
    )

    def outer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 3.0 * inner(x, y)

    outer.__module__ = "megatron.core.fusions.outer"
    compiled = compile_megatron_on_first_call(outer, backend=_counting_backend(outer_compilations))
    x, y = torch.arange(4.0), torch.ones(4)
    assert torch.equal(compiled(x, y), 3.0 * (2.0 * x + y))
    assert outer_compilations == [2] and inner_compilations == [], (outer_compilations, inner_compilations)
