"""Code that runs inside the ranks of the planner's memory checks (tests/distributed/test_planner_memory.py): what a
real GPTModel (our builders: Megatron's local spec, `SDPAttention`) saves for its backward per transformer layer,
and how many parameters each rank of a layout holds."""

from __future__ import annotations

import dataclasses

import torch

from megatron_ppo.config.schema import MegatronConfig, ModelConfig
from megatron_ppo.models import build_role_model, unwrap
from megatron_ppo.models.packing import build_pack
from megatron_ppo.parallel import init_distributed

# f ≠ 4h (SwiGLU), GQA (2 groups for 4 heads), RoPE, RMSNorm: a Llama/Qwen layer at tiny shapes; fp32 as the CPU runs
MODEL = ModelConfig(
    name="planner", num_layers=1, hidden_size=64, ffn_hidden_size=176, num_attention_heads=4, num_query_groups=2,
    vocab_size=100, max_position_embeddings=128, params_dtype="fp32", make_vocab_size_divisible_by=8,
    transformer_impl="local",
)  # fmt: skip
VARIANTS = {  # the model changes of the variants measured beside MODEL
    "llama": {},
    "qwen3": {"qk_layernorm": True},  # QK layernorm before RoPE
    "gpt2": {"normalization": "LayerNorm", "activation": "gelu", "position_embedding_type": "learned_absolute",
             "add_bias_linear": True, "ffn_hidden_size": 256},
}  # fmt: skip
ROWS, WIDTH = 4, 64  # padded: 4 rows of 64 tokens
LENGTHS = [64, 40, 90, 62]  # packed: one pack of 256 tokens, sequences of even lengths (no padding at TP 2 + SP)
RECOMPUTE = {
    None: {},
    "selective": {"recompute_granularity": "selective"},
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
}


def _layer_bytes(model: ModelConfig, layout: MegatronConfig, packed: bool) -> int:
    """Bytes the second of two transformer layers saves for the backward on this rank, during one forward: the
    tensors autograd saves (`torch.autograd.graph.saved_tensors_hooks`) from that layer's start to the final norm's,
    each storage once (a saved view holds its whole base alive and counts as that base), parameters left out.
    The window holds the layer's own input (first saved by its norm, or under full recompute by its checkpoint,
    which saves after the layer's forward returns) and nothing of the embedding or the output layer."""
    chunk = unwrap(build_role_model("actor", dataclasses.replace(model, num_layers=2), layout).chunks[0])
    parameters = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    storages: dict[int, int] = {}
    window: list[set[int]] = []  # the storages saved before the window opens, then before it closes
    chunk.decoder.layers[1].register_forward_pre_hook(lambda *_: window.append(set(storages)))
    chunk.decoder.final_layernorm.register_forward_pre_hook(lambda *_: window.append(set(storages)))

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    generator = torch.Generator().manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if packed:
            multiple = layout.tensor_model_parallel_size if layout.sequence_parallel else 1
            pack_ = build_pack(LENGTHS, max(LENGTHS), multiple)
            ids = torch.randint(0, model.vocab_size, (1, pack_.width), generator=generator)
            chunk(ids, pack_.position_ids, None, packed_seq_params=pack_.params)
        else:
            ids = torch.randint(0, model.vocab_size, (ROWS, WIDTH), generator=generator)
            chunk(ids, torch.arange(WIDTH).expand(ROWS, WIDTH), None)
    opened, closed = window
    return sum(storages[ptr] for ptr in closed - opened)


def _parameters(model: ModelConfig, layout: MegatronConfig, role: str) -> int:
    """Parameters this rank holds of `role`'s model (every chunk; DDP's wrapper adds none)."""
    built = build_role_model(role, model, layout)
    return sum(p.numel() for chunk in built.chunks for p in unwrap(chunk).parameters())


def measure(rank: int, world_size: int) -> dict[str, dict]:
    """On 2 ranks: the bytes per layer at TP 2 with and without sequence parallelism, for every recompute, padded
    and packed (the other variants at TP 2 + SP without recompute, padded); the
    parameters per rank of the actor and the critic at TP 2, PP 2 (untied and tied embeddings) and PP 2 × VPP 2."""
    layouts = {"tp2": MegatronConfig(tensor_model_parallel_size=2),
               "tp2-sp": MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)}  # fmt: skip
    activations: dict[tuple, float] = {}
    for name, base in layouts.items():
        init_distributed(base, seed=1, device="cpu")
        for recompute, fields in RECOMPUTE.items():
            for packed in (False, True):
                layout = dataclasses.replace(base, **fields)
                activations["llama", name, recompute, packed] = _layer_bytes(MODEL, layout, packed)
        if name == "tp2-sp":
            for variant in ("qwen3", "gpt2"):
                activations[variant, name, None, False] = _layer_bytes(
                    dataclasses.replace(MODEL, **VARIANTS[variant]), base, packed=False
                )
    parameters: dict[tuple, int] = {}
    stages = {
        "tp2": MegatronConfig(tensor_model_parallel_size=2),
        "pp2": MegatronConfig(pipeline_model_parallel_size=2),
        "pp2-vpp2": MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    }
    four_layers = dataclasses.replace(MODEL, num_layers=4)
    for name, layout in stages.items():
        init_distributed(layout, seed=1, device="cpu")
        for role in ("actor", "critic"):
            parameters[name, role, "untied"] = _parameters(four_layers, layout, role)
        if name == "pp2":
            tied = dataclasses.replace(four_layers, untie_embeddings_and_output_weights=False)
            parameters[name, "actor", "tied"] = _parameters(tied, layout, "actor")
    return {"activations": activations, "parameters": parameters}
