"""Spawned-rank code that initialises our critic from a small `transformers` reward model or causal LM
(`tests.support.hf_models.save_hf_scorer`) and reads its values, and the reward model's own values to compare."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from megatron.core import parallel_state

from megatron_ppo.checkpoint.initial_weights import InitialWeights
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.convert.critic_init import converted_critic_checkpoint, load_critic
from megatron_ppo.convert.huggingface import hf_model_config, hf_to_mcore
from megatron_ppo.models import build_role_model, run_micro_batches
from megatron_ppo.parallel import init_distributed

INPUT_IDS = torch.randint(1, 100, (2, 12), generator=torch.Generator().manual_seed(3))


def hf_token_values(hf_dir: str) -> torch.Tensor:
    """The reward model's score at every token, `[b, s]`: score·h_t (what it pools at the last token)."""
    model = transformers.AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model.score(model.model(INPUT_IDS).last_hidden_state)[..., 0]


def critic_values(
    rank: int, world_size: int, hf_dir: str, root: str, layout: MegatronConfig, source: str
) -> tuple[str, torch.Tensor | None]:
    """Initialise the critic as the trainer does, from `source`: "hf" (critic.model.hf_checkpoint, converted under
    `layout`), "converted" (that conversion again, as critic.model.init_checkpoint: the cache is found) or "actor"
    (an actor-only megatron-ppo checkpoint of `hf_dir` as critic.model.init_checkpoint). Returns where the weights
    came from and, on the reporting rank, the values `[b, s]`."""
    init_distributed(layout, seed=0)
    model = hf_model_config(hf_dir)
    if source == "actor":
        own = hf_to_mcore(hf_dir, Path(root) / "actor", layout=layout, model=model)
    else:
        own = converted_critic_checkpoint(hf_dir, Path(root) / "hf_init_critic", model, layout)
    critic = build_role_model("critic", model, layout)
    described = load_critic(critic, InitialWeights(critic=str(own)))

    def values(batch, output):
        return output.new_zeros(()), {"values": output[..., 0].detach().float()}

    outputs = run_micro_batches(critic, [{"input_ids": INPUT_IDS}], values, forward_only=True)
    reporting = outputs and parallel_state.get_tensor_model_parallel_rank() == 0
    return described, outputs[0]["values"] if reporting else None
