"""Small random Llama, Qwen2, Qwen3 and Qwen3-MoE models from `transformers`, a recipe training one, and
spawned-rank code for the conversion tests."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import torch
import yaml
from tokenizers import models, pre_tokenizers, trainers

from megatron_ppo.config import load_config
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.convert import fill_from_hf, hf_logits, hf_model_config, hf_to_mcore, mcore_to_hf, verify
from megatron_ppo.models import build_role_model
from megatron_ppo.models.hf_conversion import model_config_from_hf
from megatron_ppo.parallel import init_distributed
from megatron_ppo.train.run import train

# Llama 3.1's published RoPE scaling, on a base of 500 000: half of the 16-dimensional heads' frequencies are
# scaled, so the test model's logits depend on it.
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


# Qwen3-MoE's shape in small: 8 experts of FFN 48, top 2, weights renormalised (as Qwen3-30B-A3B: norm_topk_prob).
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True}


def save_hf_model(kind: str, directory: Path, tied: bool, rope: dict | None = None) -> Path:
    """A small random `transformers` model of `kind` (llama, qwen2, qwen3, qwen3_moe; Qwen3 with head_dim 32 ≠
    hidden/heads, as in Qwen3-32B; Qwen3-MoE with `QWEN3_MOE`'s experts in every layer), its norm weights drawn
    around 1 so that a misplaced norm changes the logits."""
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[kind]  # fmt: skip
    config = config_class(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384 if rope else 64, tie_word_embeddings=tied,
        initializer_range=0.2, **({"head_dim": 32} if kind.startswith("qwen3") else {}),
        **({"rope_parameters": rope} if rope else {}), **(QWEN3_MOE if kind == "qwen3_moe" else {}),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


def logit_difference(rank: int, world_size: int, hf_dir: str, megatron_dir: str, layout: MegatronConfig):
    init_distributed(layout, seed=0)
    return verify(hf_dir, megatron_dir, layout)


def _reads(hf_dir: str, layout: MegatronConfig) -> tuple[int, int]:
    model = hf_model_config(hf_dir)
    shard = build_role_model("ref", model, layout)
    read = fill_from_hf(shard, hf_dir, model, layout)
    return read, sum(p.numel() for chunk in shard.chunks for p in chunk.parameters())


def dense_under_layouts(
    rank: int, world_size: int, hf_dir: str, whole_dir: str, root: str, layouts: dict[str, MegatronConfig]
) -> dict:
    """Under each layout in turn (one process group, re-laid out): the one-process conversion's logit difference
    from `transformers` at this layout, a conversion under this layout and what this rank reads for it; then, at
    TP 1 PP 1 (data parallel over the same ranks), each of those conversions' logit difference. A difference is
    None on a rank without the last pipeline stage."""
    at, reads, converted = {}, {}, {}
    for name, layout in layouts.items():
        init_distributed(layout, seed=0)
        at[name] = verify(hf_dir, whole_dir, layout)
        converted[name] = str(hf_to_mcore(hf_dir, f"{root}/megatron-{name}", layout=layout))
        reads[name] = _reads(hf_dir, layout)
    init_distributed(MegatronConfig(), seed=0)
    return {"at": at, "reads": reads,
            "converted": {name: verify(hf_dir, out, MegatronConfig()) for name, out in converted.items()}}  # fmt: skip


def in_one_process(rank: int, world_size: int, hf_dir: str, root: str) -> dict:
    """A checkpoint (dense or MoE) in one process: converted, its largest logit difference from `transformers`, the
    largest after the way back to Hugging Face, and (bytes read, parameters held)."""
    init_distributed(MegatronConfig(), seed=0)
    megatron_dir = str(hf_to_mcore(hf_dir, f"{root}/megatron"))
    difference = verify(hf_dir, megatron_dir, MegatronConfig())
    back = mcore_to_hf(megatron_dir, hf_dir, f"{root}/back")
    input_ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    round_trip = float((hf_logits(back, input_ids) - hf_logits(hf_dir, input_ids)).abs().max())
    return {"megatron": megatron_dir, "difference": difference, "round_trip": round_trip,
            "reads": _reads(hf_dir, MegatronConfig())}  # fmt: skip


def moe_under_layouts(
    rank: int, world_size: int, hf_dir: str, whole_dir: str, root: str, layouts: dict[str, MegatronConfig]
) -> dict:
    """Under each layout in turn (one process group, re-laid out): verify the previous conversion (first the
    one-process one, at the end the last layout's at the first layout), then convert under this layout and measure
    what this rank reads. Returns {"verified": [(converted under, verified at, difference or None)], "reads":
    {layout: (bytes read, parameters held)}}."""
    names = list(layouts)
    verified, reads, previous, converted_under = [], {}, whole_dir, "one process"
    for step, name in enumerate([*names, names[0]]):
        init_distributed(layouts[name], seed=0)
        verified.append((converted_under, name, verify(hf_dir, previous, layouts[name])))
        if step < len(names):
            previous, converted_under = str(hf_to_mcore(hf_dir, f"{root}/megatron-{name}", layout=layouts[name])), name
            reads[name] = _reads(hf_dir, layouts[name])
    return {"verified": verified, "reads": reads}


def offline_recipe(root: Path, hf_dir: Path, tp: int) -> Path:
    """A recipe that trains the Hugging Face checkpoint at `hf_dir` (named as `model.hf_checkpoint`) for one PPO step
    on a word-level tokenizer.json and a few offline rows."""
    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    words = ["hello world", "hello there", "good day", "good night", "see you"]
    tokenizer.train_from_iterator(words, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "</s>"]))
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    with (root / "rows.jsonl").open("w") as rows:
        for i in range(8):
            rows.write(json.dumps({"prompt": words[i % 5], "response": words[(i + 1) % 5], "reward": i % 2}) + "\n")
    layout = {"megatron": {"tensor_model_parallel_size": tp}}
    recipe = {
        "defaults": ["defaults", "clusters/cpu"],
        "model": {**model_config_from_hf(hf_dir), "hf_checkpoint": str(hf_dir), "params_dtype": "fp32",
                  "make_vocab_size_divisible_by": 128, "tokenizer": str(root / "tokenizer.json")},
        "data": {"train_files": [str(root / "rows.jsonl")], "train_batch_size": 8, "max_prompt_length": 4,
                 "max_response_length": 4},
        "actor": {**layout, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8},
        "ref": layout,
        "critic": {**layout, "ppo_mini_batch_size": 8, "ppo_micro_batch_size_per_gpu": 8},
        "trainer": {"total_training_steps": 1, "default_local_dir": str(root / "ckpt"),
                    "log_dir": str(root / "tb"), "logger": ["tensorboard"]},
        "cluster": {"gpus_per_node": tp},
    }  # fmt: skip
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root / "recipe.yaml"


def train_recipe(rank: int, world_size: int, recipe: str, overrides: list[str]) -> int:
    """The trainer's whole path (`megatron_ppo.train.run.train`) on this recipe; the steps it ran."""
    return len(train(load_config(recipe, overrides)))
