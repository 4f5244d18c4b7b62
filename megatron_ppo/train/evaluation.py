"""Evaluation on the validation rows (`data.val_files`), every `trainer.test_freq` steps and, with
`trainer.val_before_train`, before the first step.

What it measures depends on what the rows and the config give:
- with a score function (`reward.score_fn`) and rows that carry verl's `reward_model.ground_truth`: the actor answers
  each validation prompt greedily (up to `data.max_response_length` tokens) and the answers are scored →
  `reward_mean` (what the evaluation-drop and plateau guards watch), with the decoding's `generation_*` scalars
  (prompts, tokens generated, seconds, tokens/s; KV-cached, `models.generation`);
- always: on the validation rows' own responses, the actor's mean log-prob per response token (`log_prob_mean`) and,
  with a reference model, KL(actor‖ref) per token by the k3 estimator (`kl_mean`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from megatron_ppo import algo
from megatron_ppo.data.parse import Row, Tokenizer
from megatron_ppo.data.scoring import Scorer
from megatron_ppo.models import RoleModel, eval_mode
from megatron_ppo.models.generation import timed_generate
from megatron_ppo.parallel.device import current_device, to_device
from megatron_ppo.train.batch import collate
from megatron_ppo.train.experience import forward_per_token, log_prob_fn
from megatron_ppo.train.micro_batching import MicroBatching


class Evaluator(Protocol):
    """What the trainer evaluates with: `(actor, reference) → {name: value}` (`reward_mean` when it scores answers;
    `generation_*`, the decoding's speed, which the trainer logs as `perf/eval_generation_*`)."""

    gives_reward: bool

    def __call__(self, actor: RoleModel, ref: RoleModel | None) -> dict[str, float]: ...

    def describe(self) -> str: ...


class ValidationSet:
    """The validation rows of a dataset run and how to score a fresh answer to them."""

    def __init__(
        self, rows: Sequence[Row], tokenizer: Tokenizer, scorer: Scorer | None, max_new_tokens: int,
        micro_batch_size: int | None,
    ) -> None:  # fmt: skip
        self.rows, self.tokenizer, self.scorer = list(rows), tokenizer, scorer
        self.max_new_tokens, self.micro_batch_size = max_new_tokens, micro_batch_size
        self.scored = [row for row in self.rows if row.ground_truth is not None]

    @property
    def gives_reward(self) -> bool:
        return self.scorer is not None and bool(self.scored)

    def describe(self) -> str:
        if self.gives_reward:
            return (f"{len(self.rows)} validation rows; {len(self.scored)} with a ground truth are answered greedily "
                    f"and scored by {self.scorer.name} → eval/reward_mean")  # fmt: skip
        why = "no reward.score_fn" if self.scorer is None else "no row has reward_model.ground_truth"
        return (f"{len(self.rows)} validation rows: log-prob and KL only ({why}: no eval/reward_mean, so the "
                "evaluation-drop and plateau guards are off)")  # fmt: skip

    @torch.no_grad()
    def __call__(self, actor: RoleModel, ref: RoleModel | None) -> dict[str, float]:
        out = {}
        if self.gives_reward:
            generation = timed_generate(
                actor, [row.prompt_ids for row in self.scored], max_new_tokens=self.max_new_tokens,
                eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id, greedy=True,
            )  # fmt: skip
            rewards = [
                self.scorer(row.data_source, self.tokenizer.decode(tokens), row.ground_truth, row.extra_info or {})
                for row, (tokens, _) in zip(self.scored, generation.answers, strict=True)
            ]
            out["reward_mean"] = sum(rewards) / len(rewards)
            out.update(generation.metrics())
        batch = to_device(collate(self.rows, self.tokenizer.pad_id), current_device(), "the validation batch")
        mask = batch["loss_mask"]
        log_prob = _log_probs(actor, batch, self.micro_batch_size)
        out["log_prob_mean"] = float(algo.masked_mean(log_prob, mask))
        if ref is not None:
            kl = algo.kl_penalty(log_prob, _log_probs(ref, batch, self.micro_batch_size), "low_var_kl")
            out["kl_mean"] = float(algo.masked_mean(kl, mask))
        return out


def _log_probs(model: RoleModel, batch, micro_batch_size: int | None) -> torch.Tensor:
    with eval_mode(model):
        return forward_per_token(model, batch, log_prob_fn(model), MicroBatching(rows=micro_batch_size))
