"""The fault drill patches the trainer's functions where they are called; a patch of a name its owner no longer
holds or calls would inject nothing and the drill would pass without its faults, so `patch` refuses it."""

from __future__ import annotations

import pytest

import megatron_ppo.train.phases as phases_module
import megatron_ppo.train.ppo as ppo_module
from tests.drill.faults import patch


def test_a_patch_of_a_name_that_moved_away_is_refused() -> None:
    """The role update was called from the trainer's module before its parts; now from the phases."""
    with pytest.raises(AssertionError, match=r"ppo\.update_role, which no longer exists"):
        patch(ppo_module, "update_role", None)


def test_a_patch_of_a_name_its_owner_does_not_call_is_refused() -> None:
    """`Phase` is in the trainer's module, but only read (`Phase.EXPERIENCE`), never called."""
    with pytest.raises(AssertionError, match="no longer calls Phase"):
        patch(ppo_module, "Phase", None)
    assert ppo_module.Phase is not None


def test_a_patch_where_the_name_is_called_is_applied() -> None:
    original = phases_module.update_role
    try:
        patch(phases_module, "update_role", "patched")
        assert phases_module.update_role == "patched"
    finally:
        phases_module.update_role = original
