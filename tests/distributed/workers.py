"""Code that runs inside the spawned ranks of the layout-parity tests (importable by the spawn start method).

The parity protocol drives the trainer's own path — `forward_passes` (experience: log-probs and values, gathered
over data-parallel ranks and broadcast from the last pipeline stage) and `update_role` with `actor_loss` and
`critic_loss` (micro-batching, Megatron's schedule, the clipped, non-finite-skipping optimizer step). A single
process builds actor and critic at TP=1 PP=1, saves them with Megatron's distributed checkpointing, and records the
experience, the update metrics, grad norms and the weights after one step. Each parallel layout then loads that
checkpoint (resharded by Megatron), repeats the same experience and update, and saves its updated weights, which a
final single process loads back at TP=1 to compare with the reference.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.utils import get_model_config

from megatron_ppo.config.schema import (
    ActorConfig,
    CriticConfig,
    MegatronConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossSettings,
    PPOConfig,
    RolloutCorrectionConfig,
)
from megatron_ppo.config.validate import resolve
from megatron_ppo.data.rows import Row
from megatron_ppo.models import build_role_model, run_micro_batches, schedule, unwrap
from megatron_ppo.models.gpt import sync_parameters
from megatron_ppo.parallel import init_distributed
from megatron_ppo.planner.phases import Phase
from megatron_ppo.train.batch import collate, replica_micro_batches
from megatron_ppo.train.experience import Experience, forward_passes, rollout_correction
from megatron_ppo.train.micro_batching import micro_batching
from megatron_ppo.train.optimizer import build_optimizer, build_scheduler, optimizer_step, zero_grads
from megatron_ppo.train.update import actor_loss, critic_loss, mini_batch_counts, update_role

MODEL = ModelConfig(
    name="parity", num_layers=4, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_query_groups=2,
    vocab_size=100, max_position_embeddings=32, position_embedding_type="rope", normalization="RMSNorm",
    activation="swiglu", params_dtype="fp32", make_vocab_size_divisible_by=8,
)  # fmt: skip
# Adam (the distributed optimizer supports no other) with eps = 1: on a first step the update is
# lr·g/(|g| + 1), smooth in the gradient, so weight differences expose gradient differences.
OPTIM = OptimConfig(optimizer="adam", lr=0.5, adam_eps=1.0, weight_decay=0.0, clip_grad=0.05)
SEED = 1234
ROWS = 8


def rows(count: int, seed: int) -> list[Row]:
    """Rows of different prompt (3–6) and response (1–7) lengths, so micro-batches have different widths."""
    rng = random.Random(seed)
    return [
        Row(prompt_ids=[rng.randrange(1, MODEL.vocab_size) for _ in range(rng.randint(3, 6))],
            response_ids=[rng.randrange(1, MODEL.vocab_size) for _ in range(rng.randint(1, 7))],
            reward=float(rng.choice([-1, 0, 1])), token_rewards=None, behavior_log_probs=None, uid=f"g{i // 2}",
            data_source="test", source=f"test:{i}")
        for i in range(count)
    ]  # fmt: skip


def experience(count: int, seed: int, passes: dict[str, torch.Tensor] | None = None) -> Experience:
    """A batch of `rows` with random old/ref log-probs, values, advantages and returns (or the given `passes`)."""
    batch = collate(rows(count, seed), pad_id=0)
    generator = torch.Generator().manual_seed(seed)
    shape = batch["loss_mask"].shape
    random_passes = {"old_log_prob": -torch.rand(shape, generator=generator) * 3,
                     "ref_log_prob": -torch.rand(shape, generator=generator) * 3,
                     "values": torch.randn(shape, generator=generator)}  # fmt: skip
    return Experience(
        **batch, **(passes or random_passes), token_level_rewards=torch.zeros(shape),
        advantages=torch.randn(shape, generator=generator), returns=torch.randn(shape, generator=generator),
    )  # fmt: skip


def with_sequence_is(exp: Experience, seed: int) -> Experience:
    """`exp` with behaviour log-probs near its old ones and the trainer's sequence-level importance weights over the
    whole batch (`rollout_correction`, IcePop band [0.2, 5]: rows outside it get weight 0)."""
    mask = exp["loss_mask"]
    noise = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed)) * 0.3
    behaviour = (exp["old_log_prob"] + noise).clamp(max=0.0) * mask
    config = PPOConfig()
    config.algorithm.rollout_correction = RolloutCorrectionConfig(rollout_is="sequence", rollout_is_threshold="0.2_5.0")
    rows_with = torch.ones(len(mask), dtype=torch.bool)
    batch, corrections, _ = rollout_correction(
        config, {**exp, "behavior_log_prob": behaviour, "behavior_rows": rows_with}, exp
    )
    assert "rollout_is_weights" in corrections
    return Experience(**batch, **corrections)


def gspo_config(config: ActorConfig) -> ActorConfig:
    """`config` with GSPO (one ratio per whole row), aggregated as its paper does."""
    return dataclasses.replace(config, policy_loss=PolicyLossSettings(loss_mode="gspo"),
                               loss_agg_mode="seq-mean-token-mean")  # fmt: skip


def ppo_config(layout: MegatronConfig, model: ModelConfig = MODEL) -> PPOConfig:
    """The roles' settings of the parity run: asymmetric clip, KL loss, entropy bonus, micro-batches of 2 rows."""
    config = PPOConfig(model=model)
    config.actor = ActorConfig(
        megatron=layout,
        optim=OPTIM,
        ppo_mini_batch_size=ROWS,
        ppo_micro_batch_size_per_gpu=2,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
    )
    config.ref.megatron = layout
    config.critic = CriticConfig(megatron=layout, optim=OPTIM, ppo_mini_batch_size=ROWS,
                                 ppo_micro_batch_size_per_gpu=2, cliprange_value=0.2)  # fmt: skip
    resolve(config)
    return config


def _build(layout: MegatronConfig, model: ModelConfig = MODEL):
    return build_role_model("actor", model, layout), build_role_model("critic", model, layout)


def _sharded(role_model) -> dict:
    if len(role_model.chunks) == 1:
        return unwrap(role_model.chunks[0]).sharded_state_dict()
    # interleaved pipeline: each virtual stage's chunk keys are prefixed as in Megatron-LM's checkpoints
    state = {}
    for index, chunk in enumerate(role_model.chunks):
        state[f"model{index}"] = unwrap(chunk).sharded_state_dict(prefix="")
    return state


def save(role_model, directory: Path) -> None:
    sync_parameters(role_model)  # the distributed optimizer's overlapped parameter all-gather
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


def _experience_and_update(config: PPOConfig, actor, ref, critic, sequence_level: bool = False) -> dict[str, Any]:
    """The trainer's steps 2, 4 and 5 on the fixed batch: experience from the models, then one critic and one actor
    update of one mini-batch each; with `sequence_level`, then a second actor update ("gspo") with GSPO's sequence
    ratio and sequence-level importance weights."""
    batch = experience(ROWS, seed=3)
    passes = forward_passes(config, batch, actor, ref, critic)
    exp = experience(ROWS, seed=3, passes=dict(passes))
    out: dict[str, Any] = {"passes": {k: v.clone() for k, v in passes.items()}}
    kl = {"kl_loss_coef": 0.1, "vocab_size": config.model.vocab_size}
    steps = [("critic", critic, partial(critic_loss, config.critic), exp),
             ("actor", actor, partial(actor_loss, config.actor, **kl), exp)]  # fmt: skip
    if sequence_level:
        steps.append(("gspo", actor, partial(actor_loss, gspo_config(config.actor), **kl), with_sequence_is(exp, 4)))
    for role, model, make_loss, role_experience in steps:
        optimizer = build_optimizer(model, OPTIM, config.actor.megatron)
        trained = "critic" if role == "critic" else "actor"  # "gspo": the actor again
        update = update_role(
            role, model, optimizer, build_scheduler(optimizer, OPTIM, total_steps=1), role_experience,
            config=getattr(config, trained), micro=micro_batching(config, Phase.update(trained))[trained],
            make_loss=make_loss,
        )  # fmt: skip
        out[f"{role}_metrics"] = update.metrics
        out[f"{role}_grad_norm"] = update.steps[0].grad_norm
    return out


def reference(
    rank: int, world_size: int, workdir: str, model: ModelConfig = MODEL, sequence_level: bool = False
) -> None:
    """TP=1 PP=1 on one process: save initial weights, run experience and update, save updated weights."""
    workdir = Path(workdir)
    init_distributed(MegatronConfig(), seed=SEED)
    actor, critic = _build(MegatronConfig(), model)
    ref = build_role_model("ref", model, MegatronConfig())
    with torch.no_grad():  # the value head starts at zero; give it weights so the values test something
        unwrap(critic.chunks[-1]).output_layer.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(5))
    save(actor, workdir / "initial" / "actor")
    save(critic, workdir / "initial" / "critic")
    load(ref, workdir / "initial" / "actor")
    result = _experience_and_update(ppo_config(MegatronConfig(), model), actor, ref, critic, sequence_level)
    torch.save({**result, "actor_weights": weights(actor), "critic_weights": weights(critic)}, workdir / "reference.pt")


def parallel_layout(
    rank: int,
    world_size: int,
    workdir: str,
    name: str,
    layout: MegatronConfig,
    model: ModelConfig = MODEL,
    max_tokens: int | None = None,
    sequence_level: bool = False,
) -> dict[str, Any]:
    """Load the reference weights into `layout`, repeat experience and update (in token-budget micro-batches of
    `max_tokens` when given); report differences from the reference (every rank holds the experience and the
    metrics)."""
    workdir = Path(workdir)
    init_distributed(layout, seed=SEED + 1)  # a different seed: every weight must come from the checkpoint
    actor, critic = _build(layout, model)
    ref = build_role_model("ref", model, layout)
    load(actor, workdir / "initial" / "actor")
    load(ref, workdir / "initial" / "actor")
    load(critic, workdir / "initial" / "critic")
    frozen_before = weights(ref)
    expected = torch.load(workdir / "reference.pt")
    first_layer = unwrap(actor.chunks[0]).decoder.layers[0]
    forwards = {"layer": 0, "core_attention": 0}  # activation recompute runs them again in the backward
    for part, module in (("layer", first_layer), ("core_attention", first_layer.self_attention.core_attention)):
        module.register_forward_hook(lambda *_, part=part: forwards.__setitem__(part, forwards[part] + 1))
    rope_per_token = rope_angles_seen(actor)
    config = ppo_config(layout, model)
    if max_tokens is not None:
        for role in (config.actor, config.critic):
            role.use_dynamic_bsz, role.ppo_max_token_len_per_gpu = True, max_tokens
    with pipeline_passes_seen([actor, ref, critic]) as passes_seen:
        ours = _experience_and_update(config, actor, ref, critic, sequence_level)
    roles = ("actor", "critic", "gspo") if sequence_level else ("actor", "critic")
    report: dict[str, Any] = {
        **{f"{role}_grad_norm": (ours[f"{role}_grad_norm"], expected[f"{role}_grad_norm"]) for role in roles},
        "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        "value_head_on_this_rank": any(
            type(getattr(unwrap(c), "output_layer", None)).__name__ == "ValueHead" for c in critic.chunks
        ),
        "ref_weights_unchanged": all(torch.equal(v, frozen_before[k]) for k, v in weights(ref).items()),
        "ref_has_no_grad": all(not p.requires_grad for c in ref.chunks for p in c.parameters()),
        "actor_first_layer_forwards": forwards,
        "rope_angles_per_token": rope_per_token,
        "chunks": len(actor.chunks),
        "pipeline_passes": passes_seen,
        "actor_tokens_computed": actor.padding.padded,
        "actor_tokens": (actor.padding.padded, int(actor.padding.real)),
        "pass_notes": sorted(note for model in (actor, ref, critic) for note in model.pass_notes),
        "metrics": {(f"gspo:{key}" if role == "gspo" else key): (value, expected[f"{role}_metrics"][key])
                    for role in roles for key, value in ours[f"{role}_metrics"].items()},
    }  # fmt: skip
    mask = experience(ROWS, seed=3)["loss_mask"]  # padding positions hold whatever the model gave there
    for key in ("old_log_prob", "ref_log_prob", "values"):
        report[key] = float(((ours["passes"][key] - expected["passes"][key]) * mask).abs().max())
    save(actor, workdir / name / "actor")
    save(critic, workdir / name / "critic")
    return report


def rope_angles_seen(role_model) -> dict[int, set[tuple[bool, bool]]]:
    """For each chunk of `role_model` with RoPE, per forward (filled as the chunks run): (packed, whether the angles
    its rotary embedding handed the layers had one row per token of the `[1, T]` pack, `[T, 1, 1, d]`). A pack of
    several sequences rotated by Megatron's THD table would have a row per position of its longest sequence."""
    seen: dict[int, set[tuple[bool, bool]]] = {}
    for index, chunk in enumerate(role_model.chunks):
        gpt = unwrap(chunk)
        if getattr(gpt, "rotary_pos_emb", None) is None:
            continue
        width: list[int] = [0]
        gpt.register_forward_pre_hook(lambda _m, args, _k, width=width: width.__setitem__(0, args[1].shape[-1]),
                                      with_kwargs=True)  # fmt: skip
        gpt.rotary_pos_emb.register_forward_hook(
            lambda _m, _a, kwargs, angles, i=index, width=width: seen.setdefault(i, set()).add(
                (kwargs.get("packed_seq", False), angles.shape[0] == width[0])
            ),
            with_kwargs=True,
        )
    return seen


@contextmanager
def pipeline_passes_seen(role_models: list) -> Iterator[list[dict[str, Any]]]:
    """Each schedule pass run inside the block: Megatron's `variable_seq_lengths` as the pass began and the
    `[s, b, h]` shapes that entered the decoders of `role_models` (on a later pipeline stage, the received pipeline
    messages)."""
    passes: list[dict[str, Any]] = []
    real = schedule.get_forward_backward_func

    def pass_start():
        run = real()

        def watched(**kwargs):
            chunks = kwargs["model"] if isinstance(kwargs["model"], list) else [kwargs["model"]]
            variable = get_model_config(chunks[0]).variable_seq_lengths
            passes.append({"variable_seq_lengths": variable, "shapes": set()})
            return run(**kwargs)

        return watched

    def seen(decoder, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is None:  # a later stage's decoder reads the received message from its input_tensor
            hidden = decoder.input_tensor
        if passes and hidden is not None:
            passes[-1]["shapes"].add(tuple(hidden.shape))

    hooks = [unwrap(chunk).decoder.register_forward_pre_hook(seen, with_kwargs=True)
             for role_model in role_models for chunk in role_model.chunks]  # fmt: skip
    schedule.get_forward_backward_func = pass_start
    try:
        yield passes
    finally:
        schedule.get_forward_backward_func = real
        for hook in hooks:
            hook.remove()


def parallel_layouts(
    rank: int,
    world_size: int,
    workdir: str,
    runs: list[tuple],
    model: ModelConfig = MODEL,
    sequence_level: bool = False,
    packed: Collection[str] = (),
) -> dict[str, dict[str, Any]]:
    """`parallel_layout` for each (name, layout, max_tokens) of `runs` in turn, in one process group re-laid out
    between them (one launch for every layout of a world size); the layouts named in `packed` run with
    `model.pack_sequences` (against the padded reference)."""
    return {name: parallel_layout(rank, world_size, workdir, name, layout,
                                  dataclasses.replace(model, pack_sequences=True) if name in packed else model,
                                  max_tokens, sequence_level)
            for name, layout, max_tokens in runs}  # fmt: skip


def run_layouts(
    launch,
    workdir: str,
    layouts: dict[str, tuple],
    max_tokens: dict[str, int] | None = None,
    model: ModelConfig = MODEL,
    sequence_level: bool = False,
    packed: Collection[str] = (),
) -> dict[str, list[dict[str, Any]]]:
    """Every layout of {name: (world size, layout)} through `parallel_layouts`, one launch (`launch`, the harness's
    `run_distributed`) per world size; {name: the reports of its ranks}. `packed`: the layouts that pack."""
    reports: dict[str, list[dict[str, Any]]] = {}
    for world in sorted({world for world, _ in layouts.values()}):
        runs = [(name, layout, (max_tokens or {}).get(name)) for name, (w, layout) in layouts.items() if w == world]
        by_rank = launch(parallel_layouts, world, workdir, runs, model, sequence_level, packed)
        reports |= {name: [ranks[name] for ranks in by_rank] for name, _, _ in runs}
    return {name: reports[name] for name in layouts}


def compare_updated_weights(
    rank: int, world_size: int, workdir: str, names: list[str], model: ModelConfig = MODEL
) -> dict[str, float]:
    """Load each layout's updated checkpoint at TP=1 PP=1 and measure the largest weight difference."""
    workdir = Path(workdir)
    init_distributed(MegatronConfig(), seed=SEED + 2)
    expected = torch.load(workdir / "reference.pt")
    actor, critic = _build(MegatronConfig(), model)
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
    config = ppo_config(layout)
    actor = build_role_model("actor", MODEL, layout)
    optimizer = build_optimizer(actor, OPTIM, layout)
    batch = experience(ROWS, seed=3)
    _, _, micro = replica_micro_batches(batch, 2)
    loss = actor_loss(config.actor, mini_batch_counts(batch), kl_loss_coef=0.1, vocab_size=MODEL.vocab_size)
    before = weights(actor)

    def step(poison: bool):
        zero_grads(actor, optimizer)
        run_micro_batches(actor, micro, loss, forward_only=False)
        if poison:
            next(p for p in actor.chunks[0].parameters() if p.requires_grad).main_grad.view(-1)[0] = float("nan")
        return optimizer_step(optimizer, OPTIM.clip_grad)

    poisoned = step(poison=rank == 1)
    unchanged = all(torch.equal(v, before[k]) for k, v in weights(actor).items())
    clean = step(poison=False)
    changed = any(not torch.equal(v, before[k]) for k, v in weights(actor).items())
    return {"poisoned_skipped": poisoned.skipped, "poisoned_norm": poisoned.grad_norm,
            "weights_unchanged": unchanged, "clean_skipped": clean.skipped, "clean_norm": clean.grad_norm,
            "weights_changed_after": changed}  # fmt: skip
