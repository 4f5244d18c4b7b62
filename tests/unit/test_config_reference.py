"""The configuration reference (docs/reference/config.md) is the schema's: every key the config accepts has its row
and its meaning, and the committed page is what the generator writes from today's schema."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from megatron_ppo.config import reference
from megatron_ppo.config.compose import _all_paths
from megatron_ppo.config.fields import ranged
from megatron_ppo.config.schema import AT_LEAST_ONE, PPOConfig

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "config.md"


@pytest.fixture(scope="module")
def generated() -> str:
    return reference.render(reference.sections(reference.verl_key_set()))


def test_the_reference_lists_every_key_the_config_accepts_each_with_its_meaning(generated: str) -> None:
    rows = dict(re.findall(r"^\| `([^`]+)` \|.*\| ([^|]*) \|$", generated, flags=re.MULTILINE))
    listed = {key.replace("[]", "") for key in rows}
    accepted = set(_all_paths(PPOConfig))  # what composition accepts (a list of sections: its items' keys)
    assert not accepted - listed, f"keys missing from the reference: {sorted(accepted - listed)}"
    sections_lists = {key for key in listed - accepted if any(a.startswith(f"{key}.") for a in accepted)}
    assert listed - accepted == sections_lists, f"rows that are no key: {sorted(listed - accepted - sections_lists)}"
    assert all(meaning.strip() for meaning in rows.values())


def test_a_key_without_its_meaning_stops_the_generation_naming_it() -> None:
    @dataclass
    class Section:
        layers: int = ranged(2, AT_LEAST_ONE, "transformer layers")
        width: int = ranged(128, AT_LEAST_ONE)

    with pytest.raises(ValueError, match=r"model\.width has no meaning"):
        list(reference._walk(Section(), "model.", set()))


def test_the_committed_page_is_the_generated_one(generated: str) -> None:
    assert PAGE.read_text() == generated, "docs/reference/config.md is stale: run `make docs` (or python -m " \
        "megatron_ppo.config.reference docs/reference/config.md) and commit it"  # fmt: skip


def test_verl_names_are_verl_keys_that_land_on_ours(generated: str) -> None:
    rows = {key: verl for key, verl in re.findall(r"^\| `([^`]+)` \|[^|]*\|[^|]*\|[^|]*\| ([^|]*) \|", generated,
                                                  flags=re.MULTILINE)}  # fmt: skip
    assert rows["actor.optim.lr"] == "`actor_rollout_ref.actor.optim.lr`"
    assert rows["model.hf_checkpoint"] == "`actor_rollout_ref.model.path`"
    assert rows["cluster.nodes"] == "`trainer.nnodes`"
    assert rows["guards.kl_explosion_threshold"] == ""  # ours alone
    assert (
        rows["actor.megatron.recompute_granularity"] == "from `actor_rollout_ref.model.enable_gradient_checkpointing`"
    )
