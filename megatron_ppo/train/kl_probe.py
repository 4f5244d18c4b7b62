"""The KL probe: KL(actor‖ref) measured after each update on one fixed set of rows (`algorithm.kl_ctrl.feedback:
probe`), the sensor a KL controller can hold a target with.

The batch's `kl/mean` measures the policy before the update, on rows that change every iteration. Its per-sequence
KL is heavy-tailed (std ≈ 2.3× the mean on the tiny recipe), so 512 rows leave ~9 % of standard error: a KL held
exactly on target would still read within ±10 % on only ~74 % of steps, and a controller fed that reading passes
the noise into β (docs/kl-tracking.md). The probe reads the same estimator

    kl/probe_mean_n = (1/P) Σ_{rows i of the probe} mean_{response tokens t of i} k(log π_n(t) − log π_ref(t))

on the same P rows every iteration, under the policy π_n this iteration's update left. Step to step its reading then
moves only as the policy does: which rows the batch drew no longer enters, and the controller sees the update's
effect at once instead of one iteration later. The rows are a fixed sample of the training rows, so the reading
differs from the population's KL by a constant of about `kl/probe_stderr` (the set's own standard error), the same
on every step.

Cost: one forward of the actor over P rows per iteration; the reference's log-probs on them are computed once (the
reference is frozen) and kept on the device (P × width floats).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_ppo.config.schema import PPOConfig
from megatron_ppo.data.prepared import rows_at
from megatron_ppo.data.rows import Row
from megatron_ppo.models import RoleModel, eval_mode
from megatron_ppo.parallel.device import current_device, to_device
from megatron_ppo.train.batch import Batch, collate
from megatron_ppo.train.experience import forward_per_token, kl_summary, log_prob_fn
from megatron_ppo.train.guards import PROBE_PREFIX
from megatron_ppo.train.micro_batching import MicroBatching


def probe_rows(config: PPOConfig, rows: Sequence[Row]) -> list[Row]:
    """`kl_ctrl.probe_rows` of the training rows (all of them when there are fewer), drawn once with `data.seed`
    and kept in the data's order: the same rows on every rank and in every run of that seed."""
    count = min(config.algorithm.kl_ctrl.probe_rows, len(rows))
    generator = torch.Generator().manual_seed(config.data.seed)
    chosen = torch.randperm(len(rows), generator=generator)[:count].sort().values
    return rows_at(rows, chosen.tolist())


class KLProbe:
    """The probe's rows on the run's device, and the reference's log-probs on them once measured."""

    def __init__(self, config: PPOConfig, rows: Sequence[Row], pad_id: int) -> None:
        self.config = config
        self.batch: Batch = to_device(collate(probe_rows(config, rows), pad_id), current_device(), "the KL probe")
        self.ref_log_prob: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.batch["input_ids"])

    @torch.no_grad()
    def measure_reference(self, ref: RoleModel, micro: MicroBatching) -> None:
        """The frozen reference's log-probs on the probe (once; a later call does nothing)."""
        if self.ref_log_prob is None:
            with eval_mode(ref):
                self.ref_log_prob = forward_per_token(ref, self.batch, log_prob_fn(ref), micro)

    @torch.no_grad()
    def measure(self, actor: RoleModel, micro: MicroBatching) -> dict[str, float]:
        """`kl/probe_mean`, `kl/probe_std`, `kl/probe_stderr` of the actor as it is now (`measure_reference` first)."""
        if self.ref_log_prob is None:
            raise RuntimeError("KLProbe.measure before measure_reference: the reference's log-probs are not taken")
        with eval_mode(actor):
            log_prob = forward_per_token(actor, self.batch, log_prob_fn(actor), micro)
        return kl_summary(self.config, log_prob, self.ref_log_prob, self.batch["loss_mask"], PROBE_PREFIX)
