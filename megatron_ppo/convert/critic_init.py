"""The critic's initial weights: its own checkpoint (`critic.model.*`), or the actor's trunk with a zero value head.

- `critic.model.hf_checkpoint` (verl's `critic.model.path`): a Hugging Face directory, converted on first use under
  the critic's layout into `<trainer.default_local_dir>/hf_init_critic`, a checkpoint holding "critic": the trunk
  through the conversion table, the value head from the checkpoint's scalar head when it has one — a
  sequence-classification model with one label (a reward model), V(h) = score·h (its `score` has no bias) — and
  zero otherwise (a causal LM, or a classifier of several labels).
- `critic.model.init_checkpoint`: a megatron-ppo checkpoint; its "critic" when it saved one (a PPO run, or the
  conversion above), else its "actor" trunk with a zero head.
- neither: `model.init_checkpoint`'s "actor" trunk and a zero head; without that (`model.allow_random_init`), the
  randomly initialised trunk as built.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from megatron_ppo.checkpoint import directory, store
from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.convert.huggingface import architecture_mismatches, fill_from_hf
from megatron_ppo.models import RoleModel, ValueHead, build_role_model, unwrap
from megatron_ppo.models.hf_conversion import SafetensorsReader

VALUE_HEAD = "output_layer"  # the critic's `ValueHead` stands where the GPT's vocabulary output layer would
HF_SCORE = "score.weight"  # `*ForSequenceClassification`'s head, [num_labels, hidden]


def converted_critic_checkpoint(
    hf_dir: str | Path, cache_dir: str | Path, model: ModelConfig, layout: MegatronConfig
) -> Path:
    """The cached conversion of `hf_dir` for the critic under `cache_dir`, converting on first use under `layout`
    (which the process groups must hold; each rank reads only its shard). `model` is the recipe's: the checkpoint
    must be the same network (tied or untied embeddings aside: the critic has no vocabulary output)."""
    found = directory.find_resumable(cache_dir)
    if found is not None:
        return found
    mismatches = [p for p in architecture_mismatches(model, hf_dir) if "untie_embeddings" not in p]
    if mismatches:
        source = str(Path(hf_dir) / "config.json")
        raise ConfigError([f"critic.model.hf_checkpoint: {problem}" for problem in mismatches], source=source)
    critic = build_role_model("critic", model, layout)
    fill_from_hf(critic, hf_dir, model, layout, skip=(f"{VALUE_HEAD}.",))
    head = hf_value_head(hf_dir, model.hidden_size)
    if head is not None:
        for value_head in _value_heads(critic):
            with torch.no_grad():
                value_head.weight.copy_(head)
    meta = {"step": 0, "hf_model": json.dumps(dataclasses.asdict(model)), "value_head": HF_SCORE if head is not None
            else "zero"}  # fmt: skip
    return store.save_checkpoint(cache_dir, 0, {"critic": critic}, {}, meta)


def hf_value_head(hf_dir: str | Path, hidden_size: int) -> torch.Tensor | None:
    """The one-label `score.weight` `[1, hidden]` of a Hugging Face sequence-classification checkpoint; None when it
    has none (a causal LM) or scores several labels."""
    reader = SafetensorsReader(hf_dir)
    if HF_SCORE not in reader or reader.shape(HF_SCORE) != [1, hidden_size]:
        return None
    return reader.get(HF_SCORE)


def load_critic(critic: RoleModel, weights: InitialWeights) -> str:
    """Initialise `critic` from the run's initial weights as the module docstring says; returns where its weights
    came from, for the log."""
    own, actor = weights.critic, weights.actor
    if own and holds_role(own, "critic"):
        store.load_weights(critic, own, "critic")
        return f"critic from the critic of {own}"
    source = own or actor
    if not source:
        return "critic: the randomly initialised trunk (model.allow_random_init) and a zero value head"
    store.load_weights(critic, source, "actor", drop=(VALUE_HEAD,))
    return f"critic from the actor trunk of {source} and a zero value head"


def holds_role(path: str | Path, role: str) -> bool:
    """Whether the megatron-ppo checkpoint at `path` (or the newest under it) saved `role`'s weights."""
    keys = dist_checkpointing.load_tensors_metadata(str(directory.resolve(path)))
    return any(key.startswith(f"{role}.") for key in keys)


def _value_heads(critic: RoleModel) -> list[ValueHead]:
    """The value head of this rank's chunks (on the last pipeline stage only)."""
    heads = [getattr(unwrap(chunk), VALUE_HEAD, None) for chunk in critic.chunks]
    return [head for head in heads if isinstance(head, ValueHead)]
