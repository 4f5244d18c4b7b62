"""Small random Hugging Face models saved the way `transformers` saves them (the sources every conversion, critic
initialisation and verl command-line test reads), and a one-step offline recipe around one."""

from __future__ import annotations

import json
from pathlib import Path

import tokenizers
import torch
import transformers
import yaml
from tokenizers import models, pre_tokenizers, trainers

from megatron_ppo.models.hf_conversion import model_config_from_hf

# Llama 3.1's published RoPE scaling, on a base of 500 000: half of the 16-dimensional heads' frequencies are
# scaled, so the test model's logits depend on it.
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip


# Qwen3-MoE's shape in small: 8 experts of FFN 48, top 2, weights renormalised (as Qwen3-30B-A3B: norm_topk_prob).
QWEN3_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48, "norm_topk_prob": True}


def tiny_hf_config(kind: str, tied: bool, rope: dict | None = None) -> transformers.PretrainedConfig:
    """The config of a small `transformers` model of `kind` (llama, qwen2, qwen3, qwen3_moe; Qwen3 with head_dim
    32 ≠ hidden/heads, as in Qwen3-32B; Qwen3-MoE with `QWEN3_MOE`'s experts in every layer)."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[kind]  # fmt: skip
    return config_class(
        vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16384 if rope else 64, tie_word_embeddings=tied,
        initializer_range=0.2, **({"head_dim": 32} if kind.startswith("qwen3") else {}),
        **({"rope_parameters": rope} if rope else {}), **(QWEN3_MOE if kind == "qwen3_moe" else {}),
    )  # fmt: skip


def save_hf_model(kind: str, directory: Path, tied: bool, rope: dict | None = None) -> Path:
    """A small random `transformers` model of `tiny_hf_config(kind, tied, rope)`, its norm weights drawn around 1 so
    that a misplaced norm changes the logits."""
    config = tiny_hf_config(kind, tied, rope)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


SCORER_CONFIG = dict(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)  # fmt: skip


def save_hf_scorer(kind: str, directory: Path, num_labels: int = 1) -> Path:
    """A random Qwen2 (`kind`: "qwen2", with QKV bias) or Llama sequence classifier of `num_labels` labels, its score
    drawn large enough that a misplaced head shows, or (num_labels 0) a causal LM."""
    config_class = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}[kind]
    config = config_class(**SCORER_CONFIG, num_labels=max(num_labels, 1), initializer_range=0.2)
    torch.manual_seed(0)
    if num_labels == 0:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return directory


def save_word_tokenizer(root: Path, texts: list[str]) -> Path:
    """A word-level tokenizer.json of the words in `texts` (ids 3…; 0 <unk>, 1 <pad>, 2 </s>) in `root`."""
    tokenizer = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "</s>"]))
    tokenizer.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    return root / "tokenizer.json"


def scoring_recipe(root: Path, hf_dir: Path, world: int, reward_model: dict, data: dict) -> Path:
    """A recipe that scores `data.train_files` with `reward_model` (the `reward_model` section) on `world` CPU
    processes; the policy's model is the reward model's shape (only its tokenizer is read)."""
    recipe = {
        "defaults": ["defaults", "clusters/cpu"],
        "model": {**model_config_from_hf(hf_dir), "params_dtype": "fp32", "make_vocab_size_divisible_by": 128,
                  "tokenizer": str(root / "tokenizer.json")},
        "data": data,
        "reward_model": reward_model,
        "trainer": {"default_local_dir": str(root / "ckpt")},
        "cluster": {"gpus_per_node": world},
    }  # fmt: skip
    (root / "score.yaml").write_text(yaml.safe_dump(recipe))
    return root / "score.yaml"


def offline_recipe(root: Path, hf_dir: Path, tp: int) -> Path:
    """A recipe that trains the Hugging Face checkpoint at `hf_dir` (named as `model.hf_checkpoint`) for one PPO step
    on a word-level tokenizer.json and a few offline rows."""
    words = ["hello world", "hello there", "good day", "good night", "see you"]
    save_word_tokenizer(root, words)
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
