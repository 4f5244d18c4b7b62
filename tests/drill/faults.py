"""Fault injection for the drill — test-only: it patches the trainer's functions in the drill's own processes and adds
no configuration key. Each fault is applied once, in the iteration (or evaluation) of its step, even when a rollback
runs that step again.

- `nan_gradient`: one NaN in the actor's gradient on the last rank only, before the first optimizer step of the step;
- `loss_spike`: the actor's loss × 1000 throughout the step (its gradients and its logged loss with it);
- `out_of_memory`: `torch.OutOfMemoryError` raised on every rank in the actor update's first mini-batch;
- `out_of_memory_mid_phase`: the same in its second mini-batch, after the first one's optimizer step (the retry
  repeats only the second: nothing is stepped twice);
- `out_of_memory_one_rank` (the one-rank drill): the same on the last rank only, which the others cannot join in a
  retry: the run stops with one message and its checkpoint left;
- `kl_blowup`: every actor optimizer step of the iteration at 100 × the learning rate (the update's own KL sees it);
- `kl_blowup_at_save`: only the iteration's last actor optimizer step at 100 × the learning rate, in an iteration
  that ends with a save: its update's KL cannot see it, the next iteration's guards do. "The learning rate" is the
  schedule's before the guards' back-offs, so a blow-up after a rollback is as large as one before it;
- `eval_drop`: the evaluation after the step scores 0.5 lower;
- `stop` (the guard-stop drill): a NaN gradient in every iteration from the step on.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch

import megatron_ppo.tasks.addition.recipe as recipe_module
import megatron_ppo.train.phases as phases_module
import megatron_ppo.train.ppo as ppo_module
import megatron_ppo.train.update as update_module

BEST_EVAL = "best_eval"  # an evaluation drop returns to the checkpoint saved at the best evaluation the run holds


@dataclass(frozen=True)
class Fault:
    name: str
    step: int  # the iteration it is injected in (eval_drop: the evaluation after that iteration)
    guards: tuple[str, ...]  # the guards that must answer it, the one that repairs it first
    fires_at: int  # the step at which they must fire
    # the step of the checkpoint its rollback must load; BEST_EVAL: the best evaluation's, read from the run's own
    # evaluations; None: no rollback
    loads: int | str | None = None


def schedule(
    nan: int, spike: int, oom: tuple[int, int], blowup: tuple[int, int], drop: int, at_save: tuple[int, int]
) -> list[Fault]:
    """The drill's faults; `oom` is (the step of the error at the update's start, the step of the one mid-phase);
    `blowup` and `at_save` are (the step injected, the checkpoint its rollback loads)."""
    kl_guards = ("kl_explosion", "kl_bump", "watch")
    return [
        Fault("nan_gradient", nan, ("nonfinite",), nan),
        Fault("loss_spike", spike, ("loss_explosion", "grad_norm"), spike, loads=0),
        Fault("out_of_memory", oom[0], ("out_of_memory",), oom[0]),
        Fault("out_of_memory_mid_phase", oom[1], ("out_of_memory",), oom[1]),
        Fault("kl_blowup", blowup[0], kl_guards, blowup[0], loads=blowup[1]),  # the update's own KL sees it
        Fault("eval_drop", drop, ("eval_drop",), drop, loads=BEST_EVAL),
        # its last step is seen in the next iteration, after the save: the rollback passes that save over
        Fault("kl_blowup_at_save", at_save[0], kl_guards, at_save[0] + 1, loads=at_save[1]),
    ]


def one_rank_out_of_memory_schedule(step: int) -> list[Fault]:
    """The one-rank drill: an out-of-memory error on the last rank only, in the actor's second mini-batch of `step`."""
    return [Fault("out_of_memory_one_rank", step, ("out_of_memory",), step)]


def stop_schedule(step: int) -> list[Fault]:
    """The guard-stop drill: NaN gradients from `step` on stop the run there (guards.max_consecutive_skips=0)."""
    return [Fault("stop", step, ("nonfinite",), step)]


@dataclass
class Injector:
    faults: list[Fault]
    step: int = 0  # the iteration under way (or just finished, during its evaluation)
    role: str | None = None
    model: Any = None
    scheduler: Any = None  # the role update's learning-rate schedule (its back-off)
    steps_left: int = 0  # the optimizer steps left in the role update under way
    mini_batch: int = 0  # the mini-batch of the role update under way whose forward-backward runs (0: the first)
    done: set[str] = field(default_factory=set)
    applied: set[str] = field(default_factory=set)

    def due(self, name: str) -> bool:
        fault = next((f for f in self.faults if f.name == name), None)
        if fault is None:
            return False
        if name == "stop":
            return self.step >= fault.step
        return fault.step == self.step and name not in self.done

    def mark(self, name: str) -> None:
        self.applied.add(name)

    def actor_gradients(self) -> list[torch.Tensor]:
        return [p.main_grad for chunk in self.model.chunks for p in chunk.parameters() if p.requires_grad]


def patch(owner: Any, name: str, replacement: Any) -> None:
    """Set `owner.name` (a module's global, a class's method) to `replacement`, where it is called: the owner's own
    source must call `name(` — a patch of a name the code no longer calls from there would inject nothing, and the
    drill would pass without its faults (when the code moves, move the patch)."""
    if not hasattr(owner, name):
        raise AssertionError(f"the drill patches {owner.__name__}.{name}, which no longer exists: follow the code")
    source = inspect.getsource(owner)
    called = f"{name}(" in source or (inspect.isclass(owner) and f"def {name}(" in source)
    if not called:
        raise AssertionError(f"{owner.__name__} no longer calls {name}(): the drill's patch of it would inject "
                             "nothing; patch the module that calls it now")  # fmt: skip
    setattr(owner, name, replacement)


def install(injector: Injector) -> None:
    """Patch the trainer's iteration, the role update, its forward-backward, the optimizer step and the task's
    scoring, each where it is called (`patch`)."""
    iteration, update_role, actor_loss = (
        ppo_module.PPOTrainer.iteration,
        phases_module.update_role,
        update_module.actor_loss,
    )
    optimizer_step, score = update_module.optimizer_step, recipe_module.score
    run_micro_batches = update_module.run_micro_batches
    last_rank = int(os.environ.get("WORLD_SIZE", "1")) - 1

    def drilled_iteration(trainer: ppo_module.PPOTrainer) -> dict[str, float]:
        injector.step, injector.applied = trainer.step + 1, set()
        try:
            return iteration(trainer)
        finally:
            injector.done |= injector.applied

    def drilled_update_role(role: str, model: Any, *args: Any, **kwargs: Any) -> Any:
        injector.role, injector.model, injector.mini_batch = role, model, 0
        injector.scheduler = args[1]  # (optimizer, scheduler, experience, ...)
        rows = args[2]["input_ids"].shape[0]
        injector.steps_left = kwargs["config"].ppo_epochs * -(-rows // kwargs["config"].ppo_mini_batch_size)
        return update_role(role, model, *args, **kwargs)

    def drilled_run_micro_batches(model: Any, *args: Any, forward_only: bool, **kwargs: Any) -> Any:
        """The update's forward-backward: an out-of-memory error where a fault places it, before any collective."""
        if model.role == "actor" and not forward_only:
            placements = {"out_of_memory": 0, "out_of_memory_mid_phase": 1, "out_of_memory_one_rank": 1}
            for name, mini_batch in placements.items():
                on_this_rank = name != "out_of_memory_one_rank" or int(os.environ.get("RANK", "0")) == last_rank
                if injector.due(name) and injector.mini_batch == mini_batch and on_this_rank:
                    injector.mark(name)
                    injector.done.add(name)  # the retry must run clean
                    raise torch.OutOfMemoryError(f"drill: injected out-of-memory error ({name})")
        return run_micro_batches(model, *args, forward_only=forward_only, **kwargs)

    def drilled_optimizer_step(optimizer: Any, clip_grad: float) -> Any:
        injector.mini_batch += 1
        if injector.role != "actor":
            return optimizer_step(optimizer, clip_grad)
        injector.steps_left -= 1
        for name in ("nan_gradient", "stop"):
            if injector.due(name) and name not in injector.applied:
                injector.mark(name)
                if int(os.environ.get("RANK", "0")) == last_rank:
                    injector.actor_gradients()[0].view(-1)[0] = float("nan")
        if injector.due("kl_blowup") or (injector.due("kl_blowup_at_save") and injector.steps_left == 0):
            injector.mark("kl_blowup" if injector.due("kl_blowup") else "kl_blowup_at_save")
            # 100 × the schedule's own rate, whatever the guards have backed it off to: every blow-up is as large
            for group in optimizer.param_groups:
                group["lr"] *= 100.0 / injector.scheduler.backoff  # the schedule sets it again at its next step
        return optimizer_step(optimizer, clip_grad)

    def drilled_actor_loss(*args: Any, **kwargs: Any) -> Any:
        loss_fn = actor_loss(*args, **kwargs)

        def spiked(batch: Any, logits: torch.Tensor) -> Any:
            loss, parts = loss_fn(batch, logits)
            if injector.due("loss_spike"):
                injector.mark("loss_spike")
                pg = parts["actor/pg_loss"]
                loss, parts = loss * 1000.0, {**parts, "actor/pg_loss": dataclasses.replace(pg, value=pg.value * 1000)}
            return loss, parts

        return spiked

    def drilled_score(*args: Any, **kwargs: Any) -> dict[str, float]:
        result = score(*args, **kwargs)
        if injector.due("eval_drop"):
            injector.done.add("eval_drop")
            result = {**result, "reward_mean": result["reward_mean"] - 0.5}
        return result

    patch(ppo_module.PPOTrainer, "iteration", drilled_iteration)
    patch(phases_module, "update_role", drilled_update_role)
    patch(update_module, "actor_loss", drilled_actor_loss)  # what `update.role_loss` builds the actor's loss with
    patch(update_module, "optimizer_step", drilled_optimizer_step)
    patch(update_module, "run_micro_batches", drilled_run_micro_batches)
    patch(recipe_module, "score", drilled_score)
