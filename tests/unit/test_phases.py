"""One name per phase of an iteration (`phases.Phase`): the planner, host offload, the out-of-memory back-off and the
timing metrics all key by it; and one way to run forward passes in eval mode (`models.eval_mode`)."""

from __future__ import annotations

import pytest
import torch

from megatron_ppo.config import load_config
from megatron_ppo.models import RoleModel, eval_mode
from megatron_ppo.planner.flops import flop_parameter_count, iteration_flops
from megatron_ppo.planner.phases import PHASE_NEEDS, Phase
from megatron_ppo.planner.plan import plan
from megatron_ppo.train.micro_batching import micro_batch_keys
from megatron_ppo.train.throughput import timing_metrics

TINY = "recipes/tiny-cpu.yaml"


def test_each_phase_has_one_member_that_every_table_keys_by() -> None:
    assert list(Phase) == list(PHASE_NEEDS), "the phase table must list every phase, in order"
    assert [Phase.update(role) for role in ("critic", "actor")] == [Phase.UPDATE_CRITIC, Phase.UPDATE_ACTOR]
    assert [phase.trained_role for phase in Phase] == [None, "critic", "actor", None]
    # metric names as verl's timings spell them, and as the TensorBoard tags have always been
    assert [phase.metric for phase in Phase] == ["experience", "update_critic", "update_actor", "between_iterations"]
    config = load_config(TINY)
    assert list(plan(config).phases_gib) == list(Phase)
    params = {role: flop_parameter_count(config.model, role) for role in ("actor", "ref", "critic")}
    assert list(iteration_flops(config, params, 100.0, 1000.0)) == [Phase.EXPERIENCE, Phase.UPDATE_ACTOR,
                                                                     Phase.UPDATE_CRITIC]  # fmt: skip
    timings = {"experience": 1.0, "update_actor": 2.0, "update_critic": 0.5, "iteration": 4.0}
    assert timing_metrics(timings) == {"timing/experience_s": 1.0, "timing/update_actor_s": 2.0,
                                       "timing/update_critic_s": 0.5}  # fmt: skip
    assert micro_batch_keys(config, Phase.UPDATE_CRITIC) == {"critic": "critic.ppo_micro_batch_size_per_gpu"}
    with pytest.raises(ValueError, match="runs no model"):
        micro_batch_keys(config, Phase.BETWEEN_ITERATIONS)


def _role(role: str) -> RoleModel:
    chunks = [torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5)) for _ in range(2)]
    for chunk in chunks:
        chunk.train(role != "ref")
    return RoleModel(role, chunks, config=None, vocab_size=2, padded_vocab_size=2)  # type: ignore[arg-type]


def _modes(*models: RoleModel) -> list[bool]:
    return [module.training for model in models for chunk in model.chunks for module in chunk.modules()]


def test_eval_mode_turns_dropout_off_and_restores_train_mode_even_after_an_error() -> None:
    actor, ref, critic = _role("actor"), _role("ref"), _role("critic")
    with eval_mode(actor, ref, None, critic):
        assert not any(_modes(actor, ref, critic)), "a forward pass ran with dropout on"
    assert all(_modes(actor, critic)) and not any(_modes(ref)), "the trained roles train again, the reference not"
    with pytest.raises(RuntimeError, match="out of memory"), eval_mode(actor):
        assert not any(_modes(actor))
        raise RuntimeError("out of memory")
    assert all(_modes(actor)), "an error inside left the actor in eval mode"
