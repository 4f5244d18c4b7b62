"""Each guard rule on its own: what fires it, what it asks for, and that it stays quiet below its threshold."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ppo.config.compose import load_config
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.config.schema import GuardsConfig, WatchConfig
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.guards import Guards, scale_learning_rate
from megatron_ppo.train.kl_coefficients import KLCoefficients
from megatron_ppo.train.memory_backoff import OutOfMemoryBackoff
from megatron_ppo.train.micro_batching import MicroBatching, micro_batch_keys
from megatron_ppo.train.optimizer import BackedOffScheduler

QUIET = {"watch": []}


def kinds(actions) -> list[tuple[str, str]]:
    return [(a.kind, a.guard) for a in actions]


def test_absolute_grad_norm_threshold_backs_off_only_that_role() -> None:
    guards = Guards(GuardsConfig(grad_norm_threshold=5.0, lr_backoff_factor=0.9, **QUIET))
    assert guards.observe({"actor/grad_norm_max": 4.9, "critic/grad_norm_max": 3.0}, False) == []
    actions = guards.observe({"actor/grad_norm_max": 1.0, "critic/grad_norm_max": 5.5}, False)
    assert [(a.kind, a.role, a.factor) for a in actions] == [("lr_backoff", "critic", 0.9)]
    assert "guards.grad_norm_threshold=5.0" in actions[0].message and actions[0].value == 5.5


def test_relative_spike_fires_below_the_absolute_threshold() -> None:
    guards = Guards(GuardsConfig(grad_norm_threshold=5.0, grad_norm_spike_factor=3.0, grad_norm_window=4, **QUIET))
    for norm in [0.5, 0.6, 0.5, 0.55]:
        assert guards.observe({"actor/grad_norm_max": norm}, False) == []
    actions = guards.observe({"actor/grad_norm_max": 2.0}, False)
    assert kinds(actions) == [("lr_backoff", "grad_norm")] and "median" in actions[0].message


def test_kl_above_rollback_threshold_rolls_back_with_lower_lr() -> None:
    guards = Guards(GuardsConfig(kl_explosion_threshold=0.03, rollback_lr_factor=0.8, max_rollbacks=2, **QUIET))
    assert guards.observe({"kl/mean": 0.029}, False) == []
    (action,) = guards.observe({"kl/mean": 0.031}, False)
    assert (action.kind, action.guard, action.factor, action.max_rollbacks, action.target) == (
        "rollback", "kl_explosion", 0.8, 2, "latest")  # fmt: skip


def test_the_kl_guards_read_the_updates_kl_and_a_non_finite_one_rolls_back() -> None:
    guards = Guards(GuardsConfig(kl_explosion_threshold=0.03, kl_bump_threshold=0.02, **QUIET))
    (bump, rollback) = sorted(guards.observe({"kl/mean": 0.01, "actor/ref_kl": 0.04}, False), key=lambda a: a.kind)
    assert (bump.kind, rollback.kind, rollback.value) == ("kl_bump", "rollback", 0.04)
    assert guards.observe({"kl/mean": 0.04, "actor/ref_kl": 0.01}, False) == [], "the update's KL, not the experience's"
    assert kinds(guards.observe({"kl/mean": 0.01, "actor/ref_kl": math.nan}, False)) == [("rollback", "kl_explosion")]
    assert guards.observe({"actor/pg_loss": 0.1}, False) == [], "no KL term: no KL guard"


def test_stage_override_loosens_the_kl_rollback() -> None:
    guards = Guards(GuardsConfig(kl_explosion_threshold=0.03, **QUIET))
    assert guards.observe({"kl/mean": 0.05}, False, {"kl_explosion_threshold": 0.1}) == []


def test_loss_explosion_against_running_median_and_non_finite_loss() -> None:
    guards = Guards(GuardsConfig(loss_explosion_factor=10.0, grad_norm_window=4, **QUIET))
    for loss in [0.1, -0.12, 0.09, 0.11]:
        assert guards.observe({"actor/pg_loss": loss, "critic/vf_loss": 0.3}, False) == []
    assert guards.observe({"actor/pg_loss": -0.9}, False) == []  # 9× the median |loss|: not yet
    (action,) = guards.observe({"actor/pg_loss": 5.0}, False)
    assert (action.kind, action.guard) == ("rollback", "loss_explosion") and "actor/pg_loss" in action.message
    off = Guards(GuardsConfig(loss_explosion_factor=None, **QUIET))
    (action,) = [a for a in off.observe({"critic/vf_loss": math.nan}, True) if a.kind == "rollback"]
    assert "after a skipped step" in action.message


def test_a_loss_near_zero_is_judged_against_the_absolute_floor() -> None:
    """A policy loss of whitened advantages: ±0.003 a step, then 0.08 — 27 × its median, and healthy (the default
    guards rolled such runs back until `guards.max_rollbacks` stopped them, exit 3, within 11 steps of a tiny
    Qwen2-shaped model); above `loss_explosion_floor` the factor judges again."""
    guards = Guards(GuardsConfig(loss_explosion_factor=10.0, grad_norm_window=4, **QUIET))
    for loss in [0.003, -0.002, 0.004, -0.003]:
        assert guards.observe({"actor/pg_loss": loss}, False) == []
    assert guards.observe({"actor/pg_loss": 0.08}, False) == [], "under the floor of 1.0"
    (action,) = guards.observe({"actor/pg_loss": -1.5}, False)
    assert action.guard == "loss_explosion" and "guards.loss_explosion_floor=1.0" in action.message, action.message
    strict = Guards(GuardsConfig(loss_explosion_factor=10.0, loss_explosion_floor=0.0, grad_norm_window=4, **QUIET))
    for loss in [0.003, -0.002, 0.004, -0.003]:
        strict.observe({"actor/pg_loss": loss}, False)
    assert [a.guard for a in strict.observe({"actor/pg_loss": 0.08}, False)] == ["loss_explosion"], "floor 0: as before"


def test_kl_bump_multiplies_beta_within_the_controller_clamps() -> None:
    guards = Guards(GuardsConfig(kl_bump_threshold=0.1, kl_bump_factor=1.2, kl_explosion_threshold=1.0, **QUIET))
    assert guards.observe({"kl/mean": 0.1}, False) == []
    (action,) = guards.observe({"kl/mean": 0.15}, False)
    assert (action.kind, action.factor) == ("kl_bump", 1.2)
    adaptive = ["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.stages=[]", "algorithm.kl_ctrl.max_coef=0.0012"]
    kl = KLCoefficients(load_config("recipes/qwen2.5-7b.yaml", adaptive), total_steps=100)
    assert kl.coef("loss") == 0.001
    kl.scale(1.2)
    assert kl.coef("loss") == pytest.approx(0.0012)
    kl.scale(1.2)
    assert kl.coef("loss") == pytest.approx(0.0012), "β must stay within kl_ctrl.max_coef"
    staged = KLCoefficients(load_config("recipes/qwen2.5-7b.yaml"), total_steps=100)
    staged.scale(1.2)
    assert staged.coef("loss") == 0.0, "the warm-up ramp owns β: KL is off by design there"


def test_watch_fires_once_per_crossing_with_its_action() -> None:
    rules = [WatchConfig("kl/std", 0.02, "warn"), WatchConfig("critic/vf_loss", 0.5, "lr_backoff")]
    guards = Guards(GuardsConfig(watch=rules, lr_backoff_factor=0.9))
    assert guards.observe({"kl/std": 0.01, "critic/vf_loss": 0.2}, False) == []
    first = guards.observe({"kl/std": 0.03, "critic/vf_loss": 0.7}, False)
    assert [(a.kind, a.guard) for a in first] == [("warn", "watch"), ("lr_backoff", "watch")]
    assert first[1].role is None and first[1].factor == 0.9
    assert guards.observe({"kl/std": 0.04, "critic/vf_loss": 0.8}, False) == [], "still above: no new action"
    guards.observe({"kl/std": 0.01}, False)
    assert kinds(guards.observe({"kl/std": 0.05}, False)) == [("warn", "watch")], "crossed again"


def test_evaluation_drop_rolls_back_to_best_and_plateau_backs_off() -> None:
    guards = Guards(GuardsConfig(eval_drop_fraction=0.05, plateau_evaluations=2, plateau_lr_factor=0.9, **QUIET))
    assert guards.observe_evaluation(0.60) == [] and guards.best_eval == 0.60
    assert guards.observe_evaluation(0.58) == []  # 3 % below the best: inside the band
    (plateau,) = guards.observe_evaluation(0.59)
    assert (plateau.kind, plateau.guard, plateau.factor) == ("lr_backoff", "plateau", 0.9)
    (drop,) = guards.observe_evaluation(0.56)  # 6.7 % below
    assert (drop.kind, drop.guard, drop.target) == ("rollback", "eval_drop", "best_eval")
    negative = Guards(GuardsConfig(eval_drop_fraction=0.05, **QUIET))
    negative.observe_evaluation(-0.5)
    assert negative.observe_evaluation(-0.52) == [] and negative.observe_evaluation(-0.53)[0].guard == "eval_drop"


def test_skips_warn_then_stop_and_state_round_trips() -> None:
    guards = Guards(GuardsConfig(max_consecutive_skips=1, **QUIET))
    assert kinds(guards.observe({}, True)) == [("warn", "nonfinite")]
    assert kinds(guards.observe({}, True)) == [("stop", "nonfinite")]
    guards.observe_evaluation(0.3)
    copy = Guards(GuardsConfig(**QUIET))
    copy.load_state_dict(guards.state_dict())
    assert copy.state_dict() == guards.state_dict()


def test_learning_rate_scaling_keeps_its_floor_and_survives_a_reload() -> None:
    """The back-off reaches the rate applied even though the parameter group carries its own `max_lr`, as every
    group of Megatron's optimizer does, and the schedule's state carries it to a rebuilt scheduler."""

    def scheduler_of(optimizer):
        return BackedOffScheduler(optimizer, init_lr=0.0, max_lr=1e-3, min_lr=0.0, lr_warmup_steps=0,
                                  lr_decay_steps=10, lr_decay_style="constant", start_wd=0.0, end_wd=0.0,
                                  wd_incr_steps=10, wd_incr_style="constant")  # fmt: skip

    def optimizer_of():
        return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "max_lr": 1e-3, "min_lr": 0.0}])

    optimizer = optimizer_of()
    scheduler = scheduler_of(optimizer)
    assert scale_learning_rate(scheduler, 0.5, floor=1e-4) == 0.5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-4)
    assert scale_learning_rate(scheduler, 0.1, floor=1e-4) == pytest.approx(0.2)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    scheduler.step(1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-4), "the next step forgot the back-off"
    reloaded_optimizer = optimizer_of()
    reloaded = scheduler_of(reloaded_optimizer)
    reloaded.load_state_dict(scheduler.state_dict())
    reloaded.step(0)
    assert reloaded_optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


def test_out_of_memory_backoff_lowers_the_micro_batch_and_persists() -> None:
    config = load_config("recipes/tiny-cpu.yaml", ["guards.max_oom_retries=2"])
    assert micro_batch_keys(config, Phase.UPDATE_ACTOR) == {"actor": "actor.ppo_micro_batch_size_per_gpu"}
    assert micro_batch_keys(config, Phase.EXPERIENCE)["critic"] == "critic.forward_micro_batch_size_per_gpu"
    backoff, calls, logged = OutOfMemoryBackoff(config), [], []

    def attempt() -> str:
        calls.append(backoff.micro_batching(Phase.UPDATE_ACTOR)["actor"].rows)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("injected")
        return "done"

    assert backoff.run(Phase.UPDATE_ACTOR, attempt, lambda: None, logged.append) == "done"
    assert calls == [128, 127] and "actor.ppo_micro_batch_size_per_gpu=127" in logged[0]
    assert config.actor.ppo_micro_batch_size_per_gpu == 128, "the back-off wrote into the config"
    assert backoff.micro_batching(Phase.EXPERIENCE)["actor"].rows == 128, "the update's size is not the experience's"
    resumed = OutOfMemoryBackoff(load_config("recipes/tiny-cpu.yaml"))
    resumed.load_state_dict(backoff.state_dict())
    assert resumed.micro_batching(Phase.UPDATE_ACTOR) == {"actor": MicroBatching(rows=127)}

    def always() -> None:
        raise torch.OutOfMemoryError("injected")

    with pytest.raises(RuntimeError, match=r"after 2 retries \(guards.max_oom_retries\)"):
        backoff.run(Phase.UPDATE_ACTOR, always, lambda: None, logged.append)
    one_row = with_changes(config, {"actor.ppo_micro_batch_size_per_gpu": 1})
    with pytest.raises(RuntimeError, match="not even one row fits"):
        OutOfMemoryBackoff(one_row).run(Phase.UPDATE_ACTOR, always, lambda: None, logged.append)


def test_out_of_memory_backoff_shrinks_a_token_budget_shared_by_actor_and_reference() -> None:
    config = load_config("recipes/tiny-cpu.yaml", ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=800"])
    backoff, failed = OutOfMemoryBackoff(config), []

    def attempt() -> None:
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError("injected")

    backoff.run(Phase.EXPERIENCE, attempt, lambda: None, lambda line: None)
    micro = backoff.micro_batching(Phase.EXPERIENCE)
    assert micro["actor"] == micro["ref"] == MicroBatching(max_tokens=700)
    assert backoff.overrides == {"actor.ppo_max_token_len_per_gpu": 700, "critic.forward_micro_batch_size_per_gpu": 127}
