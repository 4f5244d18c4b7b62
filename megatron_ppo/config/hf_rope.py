"""Reading a Hugging Face config.json's RoPE settings as Megatron's GPT takes them (validation compares them with the
recipe; the conversion builds the model config from them)."""

from __future__ import annotations

# Megatron's Llama-3 RoPE scaling (`GPTModel(rope_scaling=True, rope_scaling_factor=f)` → megatron-core 0.16.1's
# `RotaryEmbedding._apply_scaling`) takes only the factor; the other three parameters are fixed at these values.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_rope_scaling(hf_config: dict) -> tuple[float | None, list[str]]:
    """(`model.rope_scaling_factor`, problems) for a Hugging Face config.json's RoPE parameters (`rope_parameters`,
    or `rope_scaling` as published before transformers 5): None without scaling, `factor` for `rope_type: llama3`
    with Megatron's fixed parameters; any other type or parameter is a problem naming the key and the value."""
    key = "rope_parameters" if hf_config.get("rope_parameters") else "rope_scaling"
    rope = hf_config.get(key) or {}
    if any(isinstance(value, dict) for value in rope.values()):
        return None, [f"{key}={rope!r}: RoPE parameters per layer type are not supported; one set for all layers"]
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None, []
    if rope_type != "llama3":
        return None, [
            f"{key}.rope_type={rope_type!r} is not supported: Megatron's GPT applies Llama 3.1's RoPE scaling "
            "('llama3') only; use a checkpoint with rope_type 'default' or 'llama3'"
        ]
    problems = [
        f"{key}.{name}={rope.get(name)!r}: Megatron's Llama-3 RoPE scaling fixes it at {fixed}"
        for name, fixed in MEGATRON_LLAMA3_ROPE.items()
        if rope.get(name) != fixed
    ]
    factor = rope.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
        problems.append(f"{key}.factor={factor!r}: must be a number ≥ 1 (Llama 3.1: 8)")
    return (None if problems else float(factor)), problems
