"""Code that runs inside the spawned ranks of the expert-parallel tests (importable by the spawn start method)."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models import build_role_model
from megatron_ppo.parallel import init_distributed, initialize_model_parallel, seed_everything
from megatron_ppo.train.micro_batching import MicroBatching
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler
from megatron_ppo.train.update import actor_loss, update_role
from tests.distributed import workers


def load_balancing_loss_by_layout(rank: int, world_size: int, workdir: str, model: ModelConfig) -> dict[str, Any]:
    """One actor update from the reference's initial weights and experience, with `model`'s load-balancing loss, at
    DP 2 × EP 1 and at DP 2 × EP 2 (the same micro-batches on each replica, so the per-micro-batch routing
    statistics agree), at EP 2 without the loss, and at EP 2 packed
    (`model.pack_sequences`). Returns each run's aux loss, grad norm and pg_loss."""
    expected = torch.load(Path(workdir) / "reference.pt")
    exp = workers.experience(workers.ROWS, seed=3, passes=expected["passes"])
    runs = {
        "dp2": (MegatronConfig(), model),
        "ep2": (MegatronConfig(expert_model_parallel_size=2), model),
        "ep2-no-aux": (
            MegatronConfig(expert_model_parallel_size=2),
            dataclasses.replace(model, router_aux_loss_coef=0),
        ),
        # packs rounded up to 16 tokens: a tail of padding the routers must leave out
        "ep2-packed": (
            MegatronConfig(expert_model_parallel_size=2, make_sequence_length_divisible_by=16),
            dataclasses.replace(model, pack_sequences=True),
        ),
    }
    out: dict[str, Any] = {}
    for index, (name, (layout, role_model)) in enumerate(runs.items()):
        if index == 0:
            init_distributed(layout, seed=workers.SEED + 1)
        else:
            initialize_model_parallel(layout)
            seed_everything(workers.SEED + 1)
        actor = build_role_model("actor", role_model, layout)
        workers.load(actor, Path(workdir) / "initial" / "actor")
        config = workers.ppo_config(layout, role_model)
        optimizer = build_optimizer(actor, workers.OPTIM, layout)
        update = update_role(
            "actor", actor, optimizer, build_scheduler(optimizer, workers.OPTIM, total_steps=1), exp,
            config=config.actor, micro=MicroBatching(rows=config.actor.ppo_micro_batch_size_per_gpu),
            make_loss=partial(actor_loss, config.actor, kl_loss_coef=0.1, vocab_size=role_model.vocab_size),
        )  # fmt: skip
        out[name] = {
            "moe_aux_loss": update.metrics.get("actor/moe_aux_loss"),
            "grad_norm": update.steps[0].grad_norm,
            "pg_loss": update.metrics["actor/pg_loss"],
        }
    return out


def layer_against_transformers(rank: int, world_size: int) -> dict[str, float]:
    """Megatron's MoE layer as this project builds it against Hugging Face's `Qwen3MoeSparseMoeBlock` with the
    same router and expert weights, with and without top-k renormalisation: the largest output difference."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    init_distributed(MegatronConfig(), seed=0)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 3, 32, generator=generator)  # [s, b, h]
    out = {}
    for norm_topk_prob in (True, False):
        model = ModelConfig(
            name="moe-layer", num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, params_dtype="fp32",
            make_vocab_size_divisible_by=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            norm_topk_prob=norm_topk_prob,
        )  # fmt: skip
        ours = build_role_model("ref", model, MegatronConfig()).chunks[0].decoder.layers[0].mlp
        theirs = Qwen3MoeSparseMoeBlock(
            Qwen3MoeConfig(hidden_size=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                           norm_topk_prob=norm_topk_prob, hidden_act="silu")
        )  # fmt: skip
        with torch.no_grad():
            ours.router.weight.normal_(0.0, 1.0, generator=generator)  # well-separated top-k choices
            theirs.gate.weight.copy_(ours.router.weight)
            for index, expert in enumerate(ours.experts.local_experts):
                theirs.experts.gate_up_proj[index].copy_(expert.linear_fc1.weight)  # [gate; up] in both
                theirs.experts.down_proj[index].copy_(expert.linear_fc2.weight)
            output, _ = ours(hidden)
            expected = theirs(hidden.transpose(0, 1).contiguous()).transpose(0, 1)
        out[f"norm_topk_prob={norm_topk_prob}"] = float((output - expected).abs().max())
    return out
