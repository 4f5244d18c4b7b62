"""Small random Llama and Qwen2 models from `transformers`, and spawned-rank code for the conversion tests."""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.convert import hf_logits, hf_to_mcore, mcore_to_hf, verify
from megatron_ppo.parallel import init_distributed


def save_hf_model(kind: str, directory: Path, tied: bool) -> Path:
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    config = config_class(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def convert(rank: int, world_size: int, hf_dir: str, out_dir: str) -> str:
    init_distributed(MegatronConfig(), seed=0)
    return str(hf_to_mcore(hf_dir, out_dir))


def logit_difference(rank: int, world_size: int, hf_dir: str, megatron_dir: str, layout: MegatronConfig):
    init_distributed(layout, seed=0)
    return verify(hf_dir, megatron_dir, layout)


def round_trip(rank: int, world_size: int, hf_dir: str, megatron_dir: str, out_dir: str) -> float:
    init_distributed(MegatronConfig(), seed=0)
    mcore_to_hf(megatron_dir, hf_dir, out_dir)
    input_ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    return float((hf_logits(out_dir, input_ids) - hf_logits(hf_dir, input_ids)).abs().max())
