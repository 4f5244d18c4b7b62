"""Validation of the parallel layouts: each role's TP/PP/VPP/CP against the model and the world, one layout shared
by the roles, the expert layout of a mixture of experts, what context parallelism needs, and what the frozen
reference may offload. Each problem names the key, the value and the fix (`validate.validate` collects them)."""

from __future__ import annotations

import importlib.util

from megatron_ppo.algo.policy_loss import SEQUENCE_LEVEL_LOSSES
from megatron_ppo.config.fields import SHARED_LAYOUT, tagged_keys
from megatron_ppo.config.layout import divisors, world_size
from megatron_ppo.config.schema import ROLES, TRAINED_ROLES, MegatronConfig, PPOConfig


def layout_problems(c: PPOConfig) -> list[str]:
    """Every layout problem of `c`, one line each."""
    return _layout_problems(c) + _moe_problems(c) + _offload_problems(c) + _context_parallel_problems(c)


# The layout every role must set alike (`fields.shared_layout`: one layout per process in Megatron's parallel_state)
SHARED_LAYOUT_KEYS = tuple(tagged_keys(MegatronConfig(), SHARED_LAYOUT))
_SHORT = {"tensor_model_parallel_size": "TP", "pipeline_model_parallel_size": "PP", "context_parallel_size": "CP",
          "expert_model_parallel_size": "EP", "expert_tensor_parallel_size": "expert-TP"}  # fmt: skip


def _layout_problems(c: PPOConfig) -> list[str]:
    p = _shared_layout_problems(c)
    world = world_size(c)
    m = c.model
    query_groups = m.num_query_groups or m.num_attention_heads
    for role in ROLES:
        mg: MegatronConfig = getattr(c, role).megatron
        key = f"{role}.megatron"
        tp, pp, cp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.context_parallel_size
        vpp = mg.virtual_pipeline_model_parallel_size or 1
        if min(tp, pp, cp, vpp) < 1:
            continue  # reported by the range check
        if world % (tp * pp * cp):
            p.append(
                f"{key}: TP×PP×CP = {tp}×{pp}×{cp} = {tp * pp * cp} does not divide the world size {world} "
                f"(cluster.nodes={c.cluster.nodes} × cluster.gpus_per_node={c.cluster.gpus_per_node}); make "
                f"TP×PP×CP one of {divisors(world)} or use a GPU count that is a multiple of {tp * pp * cp}"
            )
        if m.num_attention_heads % tp:
            p.append(
                f"{key}.tensor_model_parallel_size={tp}: model.num_attention_heads={m.num_attention_heads} "
                f"must be divisible by TP; use a TP among {divisors(m.num_attention_heads)}"
            )
        if query_groups % tp:
            p.append(
                f"{key}.tensor_model_parallel_size={tp}: model.num_query_groups={query_groups} must be "
                f"divisible by TP; use a TP among {divisors(query_groups)}"
            )
        if m.num_layers % (pp * vpp):
            p.append(
                f"{key}: model.num_layers={m.num_layers} must be divisible by PP×VPP = {pp}×{vpp}; "
                f"use PP×VPP among {divisors(m.num_layers)}"
            )
        if mg.virtual_pipeline_model_parallel_size is not None and pp < 2:
            p.append(
                f"{key}.virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size ≥ 2; "
                "unset it or raise PP"
            )
        if mg.sequence_parallel and tp < 2:
            p.append(f"{key}.sequence_parallel=True needs tensor_model_parallel_size > 1; set it to false")
        if mg.recompute_method is not None and mg.recompute_granularity != "full":
            p.append(f"{key}.recompute_method={mg.recompute_method!r} only applies with recompute_granularity='full'")
        if mg.recompute_granularity == "full" and (mg.recompute_method is None or mg.recompute_num_layers is None):
            p.append(
                f"{key}.recompute_granularity='full' needs recompute_method (uniform|block) and recompute_num_layers"
            )
    return p


def _shared_layout_problems(c: PPOConfig) -> list[str]:
    """One problem when the roles' TP/PP/CP/EP/expert-TP differ, proposing the nearest shared layout: the role's
    layout that the fewest keys must change to reach (on a tie the actor's, then the critic's — the trained models)."""
    layouts = {role: tuple(getattr(getattr(c, role).megatron, key) for key in SHARED_LAYOUT_KEYS) for role in ROLES}
    if len(set(layouts.values())) == 1:
        return []
    differing = [i for i, _ in enumerate(SHARED_LAYOUT_KEYS) if len({layout[i] for layout in layouts.values()}) > 1]
    listed = ", ".join(
        f"{role}.megatron.{SHARED_LAYOUT_KEYS[i]}={layouts[role][i]}" for i in differing for role in ROLES
    )
    changes = {
        role: [(other, i) for other in ROLES for i in differing if layouts[other][i] != layouts[role][i]]
        for role in ROLES
    }
    nearest = min(changes, key=lambda role: len(changes[role]))
    shape = " ".join(
        f"{_SHORT[key]} {value}"
        for key, value in zip(SHARED_LAYOUT_KEYS, layouts[nearest], strict=True)
        if key in SHARED_LAYOUT_KEYS[:3] or value not in (1, None)
    )  # TP, PP and CP, then the expert layout when it is set
    fixes = " ".join(f"{other}.megatron.{SHARED_LAYOUT_KEYS[i]}={layouts[nearest][i]}" for other, i in changes[nearest])
    return [
        f"{listed}: actor, ref and critic must share one parallel layout for now (Megatron's parallel_state holds one "
        f"TP/PP/CP/EP layout per process; per-role process groups are not built); the nearest shared layout is the "
        f"{nearest}'s ({shape}): set {fixes}"
    ]


def _moe_problems(c: PPOConfig) -> list[str]:
    """Mixture of experts: the expert keys against each other, each role's expert layout against the model and
    the world (Megatron's rule: EP × expert-TP × PP divides the world; with expert-TP = TP this is EP dividing
    DP × CP, the ranks the experts are spread over), and the token dispatcher against the device and batching."""
    m, p = c.model, []
    if not m.num_experts:
        for key in ("num_experts_per_tok", "moe_intermediate_size", "router_aux_loss_coef", "moe_token_dispatcher"):
            if getattr(m, key) not in (0, 0.0, "allgather"):
                p.append(f"model.{key}={getattr(m, key)!r} applies to mixture-of-experts layers, but model.num_experts"
                         "=0 (dense); set model.num_experts or drop it")  # fmt: skip
        for role in ROLES:
            mg: MegatronConfig = getattr(c, role).megatron
            if mg.expert_model_parallel_size > 1 or mg.expert_tensor_parallel_size is not None:
                p.append(f"{role}.megatron: expert_model_parallel_size={mg.expert_model_parallel_size} / "
                         f"expert_tensor_parallel_size={mg.expert_tensor_parallel_size} need experts (model."
                         "num_experts > 0); use 1 / null for a dense model")  # fmt: skip
        return p
    if not 1 <= m.num_experts_per_tok <= m.num_experts:
        p.append(f"model.num_experts_per_tok={m.num_experts_per_tok}: each token goes to 1..num_experts="
                 f"{m.num_experts} experts; set it (Qwen3-MoE: 8)")  # fmt: skip
    if m.moe_intermediate_size < 1:
        p.append("model.moe_intermediate_size=0: set each expert's FFN width (Qwen3-30B-A3B: 768)")
    world = world_size(c)
    for role in ROLES:
        key, mg = f"{role}.megatron", getattr(c, role).megatron
        tp, pp, ep = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size, mg.expert_model_parallel_size
        etp = mg.expert_tensor_parallel_size or tp
        if min(tp, pp, ep, etp, mg.context_parallel_size) < 1:
            continue  # reported by the range check
        if m.num_experts % ep:
            p.append(f"{key}.expert_model_parallel_size={ep}: model.num_experts={m.num_experts} must split evenly "
                     f"over the EP ranks; use an EP among {divisors(m.num_experts)}")  # fmt: skip
        if world % (ep * etp * pp):
            p.append(
                f"{key}: EP × expert-TP × PP = {ep}×{etp}×{pp} = {ep * etp * pp} does not divide the world size "
                f"{world}: the experts are spread over the data-parallel × context-parallel ranks "
                f"(DP×CP = {world // max(tp * pp, 1)} at TP {tp}), so EP must divide them when expert-TP = TP; "
                f"use EP among {divisors(world // (etp * pp)) if world % (etp * pp) == 0 else [1]}"
            )
        if m.moe_intermediate_size % etp:
            p.append(f"{key}: model.moe_intermediate_size={m.moe_intermediate_size} must be divisible by the "
                     f"expert TP {etp}; use an expert_tensor_parallel_size among "
                     f"{divisors(m.moe_intermediate_size)}")  # fmt: skip
        if m.add_bias_linear and etp > 1:
            p.append(f"{key}.expert_tensor_parallel_size={etp}: Megatron's experts take biases (model."
                     "add_bias_linear) only at expert TP 1; set it to 1")  # fmt: skip
        if tp > 1 and not mg.sequence_parallel:
            # without it every TP rank would hand the experts the same tokens: their gradients would count TP times
            p.append(f"{key}.tensor_model_parallel_size={tp}: Megatron trains MoE layers at TP > 1 only with sequence "
                     f"parallelism; set {key}.sequence_parallel=true")  # fmt: skip
    return p


def _context_parallel_problems(c: PPOConfig) -> list[str]:
    """CP > 1 runs only where Transformer Engine's attention passes keys and values around the CP ring (Megatron's
    local and our SDPA attention see only this rank's tokens), and only with losses that add up over tokens. (The
    roles share one CP size, checked with the layout.)"""
    cp = c.actor.megatron.context_parallel_size
    if cp <= 1:
        return []
    setting = f"actor.megatron.context_parallel_size={cp}"
    p: list[str] = []
    if c.cluster.device != "cpu" and importlib.util.find_spec("transformer_engine") is None:
        p.append(f"{setting} needs Transformer Engine's attention, which exchanges keys and values between the CP "
                 "ranks (the local attention would attend within each rank's chunks only); Transformer Engine is "
                 "not installed here: install the gpu extra, or use 1")  # fmt: skip
    if c.model.transformer_impl == "local":
        p.append(f"{setting} needs model.transformer_impl='transformer_engine' or 'auto', not 'local'")
    for role in TRAINED_ROLES:
        if (lora := getattr(c, role).lora).enabled:  # its layers are the local spec's (`uses_transformer_engine`)
            p.append(f"{setting} with {role}.lora.rank={lora.rank}: LoRA's adapters sit on Megatron's local layers, "
                     "whose attention sees only this rank's chunks of each row; train the role in full "
                     f"({role}.lora.rank=0) or use CP 1")  # fmt: skip
    if c.model.pack_sequences:
        p.append(f"model.pack_sequences=true with {setting} is not built: each packed sequence would need its own "
                 "load-balanced split over the CP ranks (2·CP chunks per sequence); set model.pack_sequences=false "
                 "or use CP 1")  # fmt: skip
    if c.model.num_experts:
        p.append(f"{setting} with mixture-of-experts layers is not built: the CP split of each row and the routers' "
                 "padding mask are not combined; use CP 1")  # fmt: skip
    for role in TRAINED_ROLES:
        if getattr(c, role).loss_agg_mode == "seq-mean-token-mean":
            p.append(f"{setting}: {role}.loss_agg_mode='seq-mean-token-mean' divides by each row's token count, "
                     "which no CP rank sees whole; use token-mean or seq-mean-token-sum(-norm), or CP 1")  # fmt: skip
    if c.actor.policy_loss.loss_mode in SEQUENCE_LEVEL_LOSSES:
        p.append(f"{setting}: actor.policy_loss.loss_mode={c.actor.policy_loss.loss_mode!r} takes one ratio per whole "
                 "row, which no CP rank sees whole; use a token-level loss (vanilla, cispo, …), or CP 1")  # fmt: skip
    return p


def _offload_problems(c: PPOConfig) -> list[str]:
    """The frozen reference has no gradients and no optimizer: only its weights can be offloaded."""
    ref = c.ref.megatron
    return [
        f"ref.megatron.{key}=true: the reference has no {what}; use ref.megatron.param_offload for its weights"
        for key, what in (("grad_offload", "gradients"), ("optimizer_offload", "optimizer states"))
        if getattr(ref, key)
    ]
