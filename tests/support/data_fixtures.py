"""Data for the data tests: small Hugging Face tokenizer directories built with the `tokenizers` library (a
byte-level BPE with the special tokens of the ChatML and Llama-3 chat formats, and a `tokenizer_config.json` holding
a chat template written here), and GSM8K-style rows in verl's RL Parquet layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
                  "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
CORPUS = [
    "You are a helpful assistant. Answer with the number only.",
    "What is 2+3? The answer is 5. What is 12 + 30? It is 42.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. #### 72",
    "Hello there! How are you today? I am fine, thank you.",
]

# Qwen2.5's ChatML layout (whitespace control, a default system message), without its tool branches.
CHATML = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'system' and loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's template as published (bos_token comes from the tokenizer's special tokens).
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

# Exercises what transformers' Jinja environment adds: trim_blocks/lstrip_blocks, its non-escaping `tojson`,
# `{% generation %}` blocks, loop controls and raise_exception.
ENVIRONMENT = """{{ bos_token }}
{% for message in messages %}
    {% if message.role == 'tool' %}{% continue %}{% endif %}
    {% if message.role == 'assistant' %}
{% generation %}{{ message.content | tojson }}{% endgeneration %}{{ eos_token }}
    {% else %}
{{ message.role }}: {{ message | tojson(sort_keys=True) }}
    {% endif %}
{% endfor %}
{% if messages[-1].role == 'assistant' %}{{ raise_exception('the last message must not be the assistant') }}{% endif %}
{% if add_generation_prompt %}assistant:{% endif %}"""

STYLES = {
    "chatml": {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
    "llama3": {"chat_template": LLAMA3, "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    "environment": {"chat_template": ENVIRONMENT, "bos_token": "<|begin_of_text|>", "eos_token": "<|im_end|>"},
    "none": {"eos_token": "<|endoftext|>"},
}


def byte_level_bpe() -> tokenizers.Tokenizer:
    tokenizer = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


def tokenizer_dir(directory: Path, style: str, **config: Any) -> Path:
    """`directory` holding the BPE's tokenizer.json and a tokenizer_config.json of `style` (updated by `config`)."""
    directory.mkdir(parents=True, exist_ok=True)
    byte_level_bpe().save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", **STYLES[style], **config}
    (directory / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    return directory


INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'
# (question, ground truth, response): correct, wrong, no answer, an answer with a thousands separator.
GSM8K = [
    ("Natalia sold clips to 48 of her friends in April, and half as many in May. How many in all?", "72",
     "48 / 2 = 24 clips in May, 48 + 24 = 72 in all.\n#### 72"),
    ("Weng earns $12 an hour for babysitting. She did 50 minutes. How much did she earn?", "10",
     "12 / 60 * 50 = 11\n#### 11"),
    ("Betty needs $100 for a wallet and has half. How much more does she need?", "5", "I am not sure."),
    ("A farm has 250 cows and buys three times as many. How many cows are there now?", "1000",
     "250 + 750 = 1,000\n#### 1,000"),
]  # fmt: skip


def verl_row(index: int, question: str, answer: str, response: str, data_source: str = "openai/gsm8k") -> dict:
    """One row as verl's examples/data_preprocess/gsm8k.py writes it, plus our `response` and `reward`."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index, "answer": answer, "question": question},
        "response": response,
        "reward": None,
    }
