"""Megatron's optimizer for a trained role, with a step that skips non-finite gradients instead of applying them."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ppo.config.schema import MegatronConfig, OptimConfig
from megatron_ppo.models.gpt import RoleModel, zero_grad_buffers
from megatron_ppo.parallel.collectives import any_rank
from megatron_ppo.train.callbacks import weak_callback


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step did: the gradient norm before clipping (TP/PP/DP-reduced, TP duplicates counted
    once) and whether the update was skipped because that norm was NaN or infinite."""

    grad_norm: float
    skipped: bool


def build_optimizer(model: RoleModel, optim: OptimConfig, layout: MegatronConfig) -> MegatronOptimizer:
    """Megatron's optimizer over the role's chunks (the distributed optimizer when the layout asks for it), and the
    schedule hooks that reduce gradients across data-parallel ranks and pipeline-tied embeddings."""
    if not model.is_trained:
        raise ValueError(f"the {model.role} model is frozen and gets no optimizer")
    config = model.config
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer=optim.optimizer,
            lr=optim.lr,
            min_lr=optim.min_lr,
            weight_decay=optim.weight_decay,
            adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2,
            adam_eps=optim.adam_eps,
            clip_grad=optim.clip_grad,
            bf16=config.bf16,
            fp16=config.fp16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=layout.use_distributed_optimizer,
        ),
        model.chunks,
    )
    # held weakly: the config belongs to the chunks, which the optimizer holds (a cycle otherwise, train/callbacks.py);
    # once the optimizer is freed the config forgets it, and the model's later passes scale their loss by 1, as
    # Megatron does for a model without an optimizer
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = weak_callback(optimizer.scale_loss)
    weakref.finalize(optimizer, _forget_loss_scaling, config, config.grad_scale_func)
    no_sync = [weak_callback(chunk.no_sync) for chunk in model.chunks]
    config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    return optimizer


def _forget_loss_scaling(config: Any, grad_scale_func: Any) -> None:
    """The freed optimizer's loss scaling off the model's config — unless another optimizer has replaced it."""
    if config.grad_scale_func is grad_scale_func:
        config.grad_scale_func = None


def zero_grads(model: RoleModel, optimizer: MegatronOptimizer) -> None:
    """Clear the DDP gradient buffers (also after an interrupted backward, `zero_grad_buffers`) and the optimizer's
    main grads before a new accumulation."""
    zero_grad_buffers(model)
    optimizer.zero_grad()


def optimizer_step(optimizer: MegatronOptimizer, clip_grad: float) -> StepResult:
    """Clip by the global norm and step — unless the norm is not finite, in which case nothing is applied.

    The norm is reduced over the model-parallel ranks; whether it is finite is then agreed over all ranks, so a
    gradient that went bad on one data-parallel replica after the reduction cannot make the replicas diverge.
    (Megatron's plain fp32 optimizer would apply a NaN update; its distributed optimizer skips only with a loss
    scaler.)
    """
    found_inf = optimizer.prepare_grads()
    grad_norm = math.inf if found_inf else float(optimizer.get_grad_norm())
    if any_rank(not math.isfinite(grad_norm)):
        grad_norm = grad_norm if not math.isfinite(grad_norm) else math.nan
        optimizer.zero_grad()
        return StepResult(grad_norm=grad_norm, skipped=True)
    if clip_grad > 0:
        for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
            parameters = inner.get_parameters()
            if parameters:
                clip_grad_by_total_norm_fp32(parameters, clip_grad, grad_norm)
    if not optimizer.step_with_ready_grads():
        return StepResult(grad_norm=grad_norm, skipped=True)
    return StepResult(grad_norm=grad_norm, skipped=False)


class BackedOffScheduler(OptimizerParamScheduler):
    """Megatron's schedule times a back-off factor that the guards lower (`guards.scale_learning_rate`):
    lr_t = backoff · schedule_t. The factor cannot live in Megatron's own peak rate: every parameter group holds its
    own `max_lr`/`min_lr`, which `get_lr` reads before the scheduler's (megatron-core 0.16.1 to 0.19), and Megatron
    matches a checkpoint's optimizer groups by those values, so scaling them breaks the next load. Saved with the
    schedule's state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.backoff = 1.0  # before Megatron's __init__, whose step(0) already reads it
        super().__init__(*args, **kwargs)

    def get_lr(self, param_group: dict) -> float:
        return self.backoff * super().get_lr(param_group)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "backoff": self.backoff}

    def load_state_dict(self, state_dict: dict) -> None:
        self.backoff = float(state_dict.get("backoff", 1.0))
        super().load_state_dict({key: value for key, value in state_dict.items() if key != "backoff"})


def build_scheduler(optimizer: MegatronOptimizer, optim: OptimConfig, total_steps: int) -> BackedOffScheduler:
    """Megatron's learning-rate (and constant weight-decay) schedule: linear warm-up from 0, then
    `lr_decay_style` down to `min_lr` over the remaining optimizer steps, times the guards' back-off. Stepped once
    per optimizer step. A resumed run keeps the saved step count and back-off and takes the rest from the config
    (Megatron's `override_opt_param_scheduler`; verl's default, `use_checkpoint_opt_param_scheduler: false`): a
    new `lr`, `min_lr` or run length applies from the resumed step on, as the run's start lists it among the keys that
    differ from the checkpoint's."""
    warmup = optim.lr_warmup_steps
    if warmup is None:
        warmup = int(optim.lr_warmup_steps_ratio * total_steps)
    return BackedOffScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=max(total_steps, warmup + 1),
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=max(total_steps, 1),
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
