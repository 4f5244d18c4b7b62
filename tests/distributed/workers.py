"""Code that runs inside the spawned ranks of the distributed tests (importable by the spawn start method).

The parity protocol: a single process builds actor and critic at TP=1 PP=1, saves them with Megatron's
distributed checkpointing, and records log-probs, entropy, values, grad norms and the weights after one clipped step.
Each parallel layout then loads that checkpoint (resharded by Megatron), repeats the same forward and step, and
saves its updated weights, which a final single process loads back at TP=1 to compare with the reference.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state

from megatron_ppo import algo
from megatron_ppo.config.schema import MegatronConfig, ModelConfig, OptimConfig
from megatron_ppo.models import build_role_model, run_micro_batches, unwrap, vocab_parallel_log_probs
from megatron_ppo.parallel import init_distributed
from megatron_ppo.train.optimizer import build_optimizer, optimizer_step, zero_grads

MODEL = ModelConfig(
    name="parity", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
    vocab_size=100, max_position_embeddings=32, position_embedding_type="rope", normalization="RMSNorm",
    activation="swiglu", params_dtype="fp32", make_vocab_size_divisible_by=8,
)  # fmt: skip
# Adam (the distributed optimizer supports no other) with eps = 1: on a first step the update is
# lr·g/(|g| + 1), smooth in the gradient, so weight differences expose gradient differences.
OPTIM = OptimConfig(optimizer="adam", lr=0.5, adam_eps=1.0, weight_decay=0.0, clip_grad=0.05)
SEED = 1234


def micro_batches() -> list[dict[str, torch.Tensor]]:
    """Four micro-batches of two sequences, of lengths 12, 9, 12, 7 (variable shapes through the pipeline)."""
    gen = torch.Generator().manual_seed(7)
    batches = []
    for length in (12, 9, 12, 7):
        input_ids = torch.randint(0, MODEL.vocab_size, (2, length), generator=gen)
        mask = torch.ones(2, length)
        mask[:, -1] = 0  # the last position has no next token
        mask[1, : length // 3] = 0  # a prompt part that is not trained on
        batches.append(
            {
                "input_ids": input_ids,
                "labels": torch.roll(input_ids, -1, dims=1),
                "mask": mask,
                "old_log_prob": -torch.rand(2, length, generator=gen) * 5,
                "advantages": torch.randn(2, length, generator=gen),
                "old_values": torch.randn(2, length, generator=gen),
                "returns": torch.randn(2, length, generator=gen),
            }
        )
    return batches


def _share(batches: list[dict]) -> list[dict]:
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    return batches[dp_rank::dp]


def _counts(batches: list[dict]) -> dict[str, Any]:
    total = sum(b["mask"].sum() for b in batches)
    return {"dp_size": parallel_state.get_data_parallel_world_size(), "batch_num_tokens": total}


def _actor_loss(counts: dict[str, Any], vocab_size: int):
    def loss_fn(batch, logits):
        log_prob, entropy = vocab_parallel_log_probs(logits, batch["labels"], vocab_size=vocab_size, with_entropy=True)
        pg_loss, _ = algo.policy_loss(
            batch["old_log_prob"], log_prob, batch["advantages"], batch["mask"], clip_ratio_low=0.2,
            clip_ratio_high=0.28, clip_ratio_c=3.0, **counts,
        )  # fmt: skip
        entropy_loss = algo.agg_loss(entropy, batch["mask"], "token-mean", **counts)
        return pg_loss - 0.01 * entropy_loss, {"log_prob": log_prob.detach(), "entropy": entropy.detach()}

    return loss_fn


def _critic_loss(counts: dict[str, Any]):
    def loss_fn(batch, output):
        values = output.squeeze(-1)
        loss, _ = algo.value_loss(
            values, batch["returns"], batch["old_values"], batch["mask"], cliprange_value=0.2, **counts
        )
        return loss, {"values": values.detach()}

    return loss_fn


def _train_step(role_model, optimizer, batches, loss_fn) -> tuple[list[dict], float, bool]:
    zero_grads(role_model, optimizer)
    outputs = run_micro_batches(role_model, batches, loss_fn, forward_only=False)
    result = optimizer_step(optimizer, OPTIM.clip_grad)
    return outputs, result.grad_norm, result.skipped


def _build(layout: MegatronConfig):
    actor = build_role_model("actor", MODEL, layout)
    critic = build_role_model("critic", MODEL, layout)
    return actor, critic


def _sharded(role_model) -> dict:
    if len(role_model.chunks) == 1:
        return unwrap(role_model.chunks[0]).sharded_state_dict()
    # interleaved pipeline: each virtual stage's chunk keys are prefixed as in Megatron-LM's checkpoints
    state = {}
    for index, chunk in enumerate(role_model.chunks):
        state[f"model{index}"] = unwrap(chunk).sharded_state_dict(prefix="")
    return state


def save(role_model, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(_sharded(role_model), str(directory))


def load(role_model, directory: Path) -> None:
    state = dist_checkpointing.load(_sharded(role_model), str(directory))
    if len(role_model.chunks) == 1:
        unwrap(role_model.chunks[0]).load_state_dict(state, strict=True)
    else:
        for index, chunk in enumerate(role_model.chunks):
            unwrap(chunk).load_state_dict(state[f"model{index}"], strict=True)


def weights(role_model) -> dict[str, torch.Tensor]:
    """This rank's parameters and buffers, keyed by chunk index and name (copies)."""
    return {
        f"{index}.{key}": value.detach().clone()
        for index, chunk in enumerate(role_model.chunks)
        for key, value in unwrap(chunk).state_dict().items()
        if isinstance(value, torch.Tensor)
    }


def reference(rank: int, world_size: int, workdir: str) -> None:
    """TP=1 PP=1 on one process: save initial weights, record outputs, step, save updated weights."""
    workdir = Path(workdir)
    init_distributed(MegatronConfig(), seed=SEED)
    actor, critic = _build(MegatronConfig())
    with torch.no_grad():  # the value head starts at zero; give it weights so the values test something
        unwrap(critic.chunks[-1]).output_layer.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    save(actor, workdir / "initial" / "actor")
    save(critic, workdir / "initial" / "critic")
    batches = micro_batches()
    counts = _counts(batches)
    actor_out, actor_norm, _ = _train_step(actor, build_optimizer(actor, OPTIM, MegatronConfig()), batches,
                                           _actor_loss(counts, MODEL.vocab_size))  # fmt: skip
    critic_out, critic_norm, _ = _train_step(critic, build_optimizer(critic, OPTIM, MegatronConfig()), batches,
                                             _critic_loss(counts))  # fmt: skip
    torch.save(
        {
            "actor_outputs": actor_out, "critic_outputs": critic_out, "actor_grad_norm": actor_norm,
            "critic_grad_norm": critic_norm,
            "actor_weights": weights(actor),
            "critic_weights": weights(critic),
        },
        workdir / "reference.pt",
    )  # fmt: skip


def _max_diff(ours: list[dict], theirs: list[dict], key: str) -> float:
    return max(float((o[key] - t[key]).abs().max()) for o, t in zip(ours, theirs, strict=True))


def parallel_layout(rank: int, world_size: int, workdir: str, name: str, layout: MegatronConfig) -> dict[str, Any]:
    """Load the reference weights into `layout`, repeat forward and step; report differences from the reference."""
    workdir = Path(workdir)
    init_distributed(layout, seed=SEED + 1)  # a different seed: every weight must come from the checkpoint
    actor, critic = _build(layout)
    reference_model = build_role_model("ref", MODEL, layout)
    load(actor, workdir / "initial" / "actor")
    load(reference_model, workdir / "initial" / "actor")
    load(critic, workdir / "initial" / "critic")
    frozen_before = weights(reference_model)
    expected = torch.load(workdir / "reference.pt")
    all_batches = micro_batches()
    batches, counts = _share(all_batches), _counts(all_batches)
    mine = slice(parallel_state.get_data_parallel_rank(), None, parallel_state.get_data_parallel_world_size())

    actor_out, actor_norm, _ = _train_step(actor, build_optimizer(actor, OPTIM, layout), batches,
                                           _actor_loss(counts, MODEL.vocab_size))  # fmt: skip
    critic_out, critic_norm, _ = _train_step(critic, build_optimizer(critic, OPTIM, layout), batches,
                                             _critic_loss(counts))  # fmt: skip
    report: dict[str, Any] = {
        "actor_grad_norm": (actor_norm, expected["actor_grad_norm"]),
        "critic_grad_norm": (critic_norm, expected["critic_grad_norm"]),
        "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        "value_head_on_this_rank": any(
            type(getattr(unwrap(c), "output_layer", None)).__name__ == "ValueHead" for c in critic.chunks
        ),
        "ref_weights_unchanged": all(torch.equal(v, frozen_before[k]) for k, v in weights(reference_model).items()),
        "ref_has_no_grad": all(not p.requires_grad for c in reference_model.chunks for p in c.parameters()),
    }
    if report["last_stage"]:
        theirs_actor, theirs_critic = expected["actor_outputs"][mine], expected["critic_outputs"][mine]
        report["log_prob"] = _max_diff(actor_out, theirs_actor, "log_prob")
        report["entropy"] = _max_diff(actor_out, theirs_actor, "entropy")
        report["values"] = _max_diff(critic_out, theirs_critic, "values")
    save(actor, workdir / name / "actor")
    save(critic, workdir / name / "critic")
    return report


def compare_updated_weights(rank: int, world_size: int, workdir: str, names: list[str]) -> dict[str, float]:
    """Load each layout's updated checkpoint at TP=1 PP=1 and measure the largest weight difference."""
    workdir = Path(workdir)
    init_distributed(MegatronConfig(), seed=SEED + 2)
    expected = torch.load(workdir / "reference.pt")
    actor, critic = _build(MegatronConfig())
    largest: dict[str, float] = {}
    for name in names:
        for role, role_model in (("actor", actor), ("critic", critic)):
            load(role_model, workdir / name / role)
            loaded = weights(role_model)
            largest[f"{name}/{role}"] = max(
                float((loaded[k] - v).abs().max()) for k, v in expected[f"{role}_weights"].items()
            )
    return largest


def nan_gradient_is_skipped(rank: int, world_size: int, layout: MegatronConfig) -> dict[str, Any]:
    """Poison one gradient on rank 1 only; every rank must skip that step, then the next step must apply."""
    init_distributed(layout, seed=SEED)
    actor = build_role_model("actor", MODEL, layout)
    optimizer = build_optimizer(actor, OPTIM, layout)
    all_batches = micro_batches()
    batches, counts = _share(all_batches), _counts(all_batches)
    before = weights(actor)

    zero_grads(actor, optimizer)
    run_micro_batches(actor, batches, _actor_loss(counts, MODEL.vocab_size), forward_only=False)
    if rank == 1:
        next(p for p in actor.chunks[0].parameters() if p.requires_grad).main_grad.view(-1)[0] = float("nan")
    poisoned = optimizer_step(optimizer, OPTIM.clip_grad)
    unchanged = all(torch.equal(v, before[k]) for k, v in weights(actor).items())
    _, clean_norm, clean_skipped = _train_step(actor, optimizer, batches, _actor_loss(counts, MODEL.vocab_size))
    changed = any(not torch.equal(v, before[k]) for k, v in weights(actor).items())
    return {"poisoned_skipped": poisoned.skipped, "poisoned_norm": poisoned.grad_norm, "weights_unchanged": unchanged,
            "clean_skipped": clean_skipped, "clean_norm": clean_norm, "weights_changed_after": changed}  # fmt: skip
