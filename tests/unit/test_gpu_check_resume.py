"""gpu-check (f)'s comparison: bitwise on the CPU; on CUDA only the gradient norms within the stated bound."""

from __future__ import annotations

from gpu_check.resume import GRAD_NORM_RTOL, _same


def test_only_gradient_norms_get_the_cuda_bound() -> None:
    near = 1.0 + GRAD_NORM_RTOL / 2
    assert _same("actor/grad_norm", 1.0, near, bounded=True) and _same("critic/grad_norm_max", 2.0, 2 * near, True)
    assert not _same("actor/grad_norm", 1.0, 1.0 + 2 * GRAD_NORM_RTOL, bounded=True), "beyond the bound"
    assert not _same("actor/grad_norm", 1.0, near, bounded=False), "the CPU holds them bitwise"
    assert not _same("actor/pg_loss", 1.0, 1.0 + 1e-9, bounded=True), "a forward metric stays bitwise on CUDA"
    assert not _same("actor/grad_norm", 1.0, None, bounded=True)
