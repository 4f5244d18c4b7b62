"""MoE routing replay (`actor.router_replay.mode`): the update's forwards send every token to the experts an
earlier pass chose, so the PPO ratio π_θ/π_old compares one network rather than two routings.

Megatron-Core's own machinery does the routing (`megatron.core.transformer.moe.router_replay.RouterReplay`, one
instance per `TopKRouter` when `TransformerConfig.moe_enable_routing_replay`): RECORD keeps the top-k indices a
router chose, REPLAY_FORWARD takes given indices and gathers the live scores at them (so the gates still get
gradients: probs = scores[replayed indices]), REPLAY_BACKWARD pops the indices queued by each replayed forward for
the activation recompute of the backward. This module binds those instances to one model and to rows:

- Bound per model, by walking the model's own chunks (`TopKRouter.layer_number`, the global layer number with the
  pipeline stage's and the virtual chunk's offset), never by position in Megatron's process-global list, which
  also holds the reference's and critic's routers (Miles #2570; NeMo-RL and verl walk the modules too).
- Records follow rows: a record pass stores, per micro-batch, the indices of every layer of each chunk, gathered
  over the sequence-parallel and context-parallel ranks back into `[rows, width]`; the pass then assembles them by
  row, gathers them over data-parallel replicas and pipeline stages: `routed_experts` `[R, W, L, K]`, the same on
  every rank, carried by the experience like a log-prob, so passes that cut micro-batches differently (experience
  vs update, token budgets) find each row's routes. Only real tokens have a record (0 at padding), so the record
  is the same whether a pass pads or packs its rows.
- Packed passes (`model.pack_sequences`, `models.packing`): the model's tokens are a `[1, T]` pack, row r's token
  t at position `Pack.index[r, t]`; records are read back per row through it (`Pack.unpack`) and targets put at
  their pack positions (`Pack.pack`), so an experience pass and an update that pack the same rows differently
  (other budgets, other groups) replay each real token's experts. A pack's alignment padding has no record: it
  goes to the fallback experts and, by the routers' `padding_mask`, stays out of the load-balancing statistics.
- Encoding: expert index + 1, 0 for "no record" (padding, the last token of an inference engine's export):
  uint8 up to 255 experts, else int32 (NCCL has no int16). Replay gives unrecorded tokens experts 0…K−1.
- Recompute: before each replayed forward of a chunk the action is REPLAY_FORWARD and the targets are set (Megatron
  queues them for the backward too); after it, REPLAY_BACKWARD, so a recomputing backward pops its own forward's
  targets in order (each consumed once: slime #951; the schedules run a chunk's backwards in its forwards' order).
  The queues are emptied at the end of every pass (without recompute nothing pops them).
- `actor/router_replay_mismatch`: during each replayed forward (not the recompute), the live top-k is computed as
  well and compared as a set with the replayed one; the metric is the fraction of recorded (token, layer) pairs
  whose set differs: how far the routers have drifted since the record.

Router paths that bypass the replay hook (the fused router, sinkhorn, quantile balancing, forced balancing, token
dropping after the replay) are refused (`replay_bypasses`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_ppo.models.context_parallel import gather_per_token
from megatron_ppo.models.packing import Pack
from megatron_ppo.parallel.collectives import gather_rows_data_parallel
from megatron_ppo.parallel.device import current_device

ROUTED_EXPERTS = "routed_experts"  # the batch/experience key: [R, W, L, K], expert index + 1, 0 = none
Action = Literal["record", "replay"]


def record_dtype(num_experts: int) -> torch.dtype:
    """The storage type of `expert index + 1`: uint8 up to 255 experts, else int32."""
    return torch.uint8 if num_experts < 256 else torch.int32


def replay_bypasses(config: TransformerConfig) -> list[str]:
    """The settings under which Megatron's router would not route through the replay hook (or would change the
    routes after it), each with what to change; empty when replay can work."""
    out = []
    if not config.num_moe_experts:
        out.append("the model is dense (model.num_experts=0): there is no routing to replay")
        return out
    if config.moe_router_fusion:
        out.append("moe_router_fusion: the fused top-k returns before the replay hook; turn the router fusion off")
    if config.moe_router_load_balancing_type in ("sinkhorn", "quantile_balancing"):
        out.append(f"moe_router_load_balancing_type={config.moe_router_load_balancing_type!r} routes without the "
                   "replay hook; use aux_loss or none")  # fmt: skip
    if getattr(config, "moe_router_force_load_balancing", False):
        out.append("moe_router_force_load_balancing routes by random logits; turn it off")
    if config.moe_expert_capacity_factor is not None:
        out.append("moe_expert_capacity_factor drops tokens after the replayed top-k; keep routing dropless")
    return out


class RouterReplayBinding:
    """One model's routers and its routing records. `chunks` are the model's pipeline chunks (DDP-wrapped or not),
    `config` its `TransformerConfig` (with `moe_enable_routing_replay`)."""

    def __init__(self, chunks: Sequence[torch.nn.Module], config: TransformerConfig) -> None:
        self.num_layers, self.topk, self.num_experts = config.num_layers, config.moe_router_topk, config.num_moe_experts
        self.sequence_parallel = config.sequence_parallel and config.tensor_model_parallel_size > 1
        self.dtype = record_dtype(self.num_experts)
        # chunk (wrapper and module) → [(layer index from 0, the router's RouterReplay)]
        self._routers: dict[int, list[tuple[int, RouterReplay]]] = {}
        self.action: Action | None = None
        self._records: dict[int, dict[int, torch.Tensor]] = {}  # micro-batch → layer → [rows, width, K]
        self._valid: dict[int, torch.Tensor] = {}  # id(RouterReplay) → [tokens] bool: tokens with a record
        self._mismatch: torch.Tensor | None = None  # [changed, recorded] (token, layer) pairs of replayed forwards
        for chunk in chunks:
            module = getattr(chunk, "module", chunk)
            routers = [(router.layer_number - 1, router.router_replay)
                       for router in getattr(module, "decoder", module).modules()
                       if isinstance(router, TopKRouter) and router.router_replay is not None]  # fmt: skip
            if not routers:
                raise RuntimeError("routing replay: a model chunk has no replay-enabled router")
            self._routers[id(chunk)] = self._routers[id(module)] = routers
            for _, replay in routers:
                self._count_mismatch(replay)

    @property
    def routers(self) -> list[tuple[int, RouterReplay]]:
        """Every (layer index, RouterReplay) of the model on this rank, once each."""
        seen = {id(replay): item for items in self._routers.values() for item in items for replay in [item[1]]}
        return sorted(seen.values(), key=lambda item: item[0])

    def start(self, action: Action) -> None:
        """Begin a pass that records (`record`) or replays the micro-batches' `routed_experts` (`replay`); the
        mismatch counts start afresh (`take_mismatch` reads the pass's)."""
        self.action = action
        self._records = {}
        self._mismatch = None

    def before_forward(
        self,
        chunk: torch.nn.Module,
        batch: Mapping[str, torch.Tensor],
        shape: tuple[int, int],
        pack: Pack | None = None,
    ) -> None:
        """Arm `chunk`'s routers for a forward of `batch` (this CP rank's tokens) entered as `shape` = (rows, local
        width), or as the `[1, T]` `pack` of its rows: RECORD, or REPLAY_FORWARD with this rank's tokens of the
        batch's `routed_experts` as targets, in the model's token order (`[s, b]` flattened; a pack's positions).
        Tokens without a record (padding, a pack's alignment padding) go to the fallback experts 0…K−1."""
        routers = self._routers[id(chunk)]
        if self.action == "record":
            for _, replay in routers:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            return
        # an empty micro-batch (`schedule._empty_micro_batches`) has no record: every token to the fallback experts
        records = batch.get(ROUTED_EXPERTS)
        if records is None:
            records = batch["input_ids"].new_zeros((0, 0, self.num_layers, self.topk), dtype=self.dtype)
        if pack is not None:  # row r's token t at pack position index[r, t]: [T, 1, L, K]
            tokens = pack.pack(_fit(records, tuple(batch["input_ids"].shape))).transpose(0, 1)
        else:
            tokens = _fit(records, shape).transpose(0, 1)  # Megatron's token order: [s, b], flattened sequence-major
        if self.sequence_parallel:
            tp, rank = (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank(),
            )
            tokens = tokens.chunk(tp, dim=0)[rank]
        tokens = tokens.reshape(-1, *records.shape[2:]).long()  # [tokens, L, K]
        fallback = torch.arange(self.topk, device=tokens.device)
        for layer, replay in routers:
            target = tokens[:, layer]
            valid = target[:, 0] > 0
            self._valid[id(replay)] = valid
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            replay.set_target_indices(torch.where(valid[:, None], target - 1, fallback))

    def after_forward(self, chunk: torch.nn.Module, index: int, lengths: torch.Tensor, width: int, entered_rows: int,
                      cp_size: int = 1, pack: Pack | None = None) -> None:  # fmt: skip
        """After `chunk`'s forward of micro-batch `index` (rows of `lengths` real tokens in `width`, entered as
        `entered_rows` rows, or as the `[1, T]` `pack` of them): keep the recorded indices as `[rows, width, K]`
        per layer, for the real tokens only (0 elsewhere: the record is the same however a pass pads or packs the
        rows), gathered over the sequence-parallel and context-parallel ranks; or set REPLAY_BACKWARD for a
        recomputing backward."""
        routers = self._routers[id(chunk)]
        if self.action == "replay":
            for _, replay in routers:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            return
        kept = self._records.setdefault(index, {})
        real = torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]
        for layer, replay in routers:
            tokens = replay.get_recorded_indices().reshape(-1, entered_rows, self.topk)  # [s, b, K]
            if self.sequence_parallel:
                group = parallel_state.get_tensor_model_parallel_group()
                parts = [torch.empty_like(tokens) for _ in range(dist.get_world_size(group))]
                dist.all_gather(parts, tokens.contiguous(), group=group)
                tokens = torch.cat(parts, dim=0)
            record = (tokens.transpose(0, 1) + 1).to(self.dtype)  # [entered rows, local width, K]
            if pack is not None:  # pack position index[r, t] → row r's token t
                kept[layer] = pack.unpack(record)
                continue
            record = record[: len(lengths)]
            if cp_size > 1:
                record = gather_per_token(record, width, parallel_state.get_context_parallel_group())
            kept[layer] = torch.where(real[..., None], record[:, :width], 0)

    def end_pass(self) -> None:
        """Disarm every router of the model (live routing again) and drop Megatron's queued targets."""
        for _, replay in self.routers:
            replay.clear_indices()
            replay.clear_router_replay_action()
        self._valid = {}
        self.action = None

    def collect(self, share: Sequence[int], groups: Sequence[Sequence[int]], num_rows: int, width: int,
                like: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """The record pass's routes by row: `[num_rows, width, L, K]` (`record_dtype`, expert + 1, 0 for none) on
        `like`'s device (the batch's), the same on every rank. `share` and `groups` are the pass's
        (`train.batch.replica_micro_batches`): this replica's rows and each micro-batch's positions in them."""
        device = current_device()  # NCCL gathers device tensors only
        own = torch.zeros((len(share), width, self.num_layers, self.topk), dtype=self.dtype, device=device)
        for index, group in enumerate(groups):
            for layer, record in self._records.get(index, {}).items():
                own[list(group), : record.shape[1], layer] = record
        self._records = {}
        full = gather_rows_data_parallel(own, num_rows)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each layer lives on one stage: the others 0
            summed = full.to(torch.int32)
            dist.all_reduce(summed, group=parallel_state.get_pipeline_model_parallel_group())
            full = summed.to(self.dtype)
        return full.to(like.device)

    def take_mismatch(self) -> float | None:
        """The fraction of recorded (token, layer) pairs whose live top-k set differed from the replayed one, over
        the replayed forwards since the last call and every rank (a collective); None when nothing was replayed."""
        counts = self._mismatch
        self._mismatch = None
        if counts is None:
            return None
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(counts)
        changed, recorded = counts.tolist()
        return changed / recorded if recorded else None

    def _count_mismatch(self, replay: RouterReplay) -> None:
        """Wrap `replay.get_replay_topk` so a replayed forward (REPLAY_FORWARD, not the recompute) also computes the
        live top-k and counts the tokens whose expert set it would change."""
        original = replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                with torch.no_grad():
                    _, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                    target = replay.target_topk_idx.to(live.device)
                    changed = (live.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1)
                    valid = self._valid[id(replay)]
                    counts = torch.stack([(changed & valid).sum(), valid.sum()]).double()
                    self._mismatch = counts if self._mismatch is None else self._mismatch + counts
            return original(scores, topk, num_groups, group_topk, default_compute_topk)

        replay.get_replay_topk = get_replay_topk


def _fit(records: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """`records` `[r, w, L, K]` as `[rows, width, L, K]` of `shape`: cut or zero-padded below and to the right."""
    out = records.new_zeros((*shape, *records.shape[2:]))
    rows, width = min(shape[0], records.shape[0]), min(shape[1], records.shape[1])
    out[:rows, :width] = records[:rows, :width]
    return out
