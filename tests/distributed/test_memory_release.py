"""Memory is freed by construction: a dropped trainer (models, optimizers, their states) and the tiny task's SFT
model are gone when the last reference goes, without the cycle collector; a pass that ran out of memory leaves
nothing on Megatron's layers for the retry to carry."""

from __future__ import annotations

import megatron.core
import pytest
from packaging.version import Version

from tests.distributed import memory_workers
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.floor


def test_dropped_trainers_and_the_sft_model_are_freed_without_the_collector(tmp_path) -> None:
    report = run_distributed(memory_workers.dropped_trainers_are_freed, 1, str(tmp_path))[0]
    assert report["alive"] == {"trainer 0": [], "trainer 1": [], "trainer 2": [], "sft": []}, (
        f"alive after the last reference went (collector off): {report['alive']}"
    )
    assert report["loss_scaling_kept"] is False, "the SFT model's config still calls its freed optimizer"


def test_a_failed_pass_is_released_before_its_retry(tmp_path) -> None:
    report = run_distributed(memory_workers.failed_pass_is_released, 1, str(tmp_path), True)[0]
    assert report["retries"] == 1 and report["finite"], report
    assert report["alive_at_retry"] is False, "the failed pass's activation was alive when the retry reached its layer"


@pytest.mark.skipif(Version(megatron.core.__version__) < Version("0.19"), reason="mlp_norm_manager is 0.19's")
def test_without_the_release_megatron_keeps_the_failed_pass(tmp_path) -> None:
    """The cause, shown: megatron-core 0.19's layer keeps the failed pass's activation through the retry (the
    back-off's gc.collect() included), which is what the release is for."""
    report = run_distributed(memory_workers.failed_pass_is_released, 1, str(tmp_path), False)[0]
    assert report["alive_at_retry"] is True, report
