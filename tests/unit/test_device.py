"""The device decision: refused where it cannot hold, GPU-side initialisation and only importable fusions on a
machine that reports CUDA, micro-batches and models on another device caught."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from megatron_ppo.config.errors import ConfigError
from megatron_ppo.config.schema import MegatronConfig, ModelConfig, PPOConfig
from megatron_ppo.models import build_transformer_config
from megatron_ppo.models.dtypes import DTYPES
from megatron_ppo.models.gpt import data_parallel_config
from megatron_ppo.models.kernels import FUSIONS, describe_kernels, importable_fusions
from megatron_ppo.parallel.device import module_device, select_device, set_cuda_max_connections, to_device


def _importable(*modules: str) -> bool:
    """Whether every module can be found (a dotted name's parents first: `find_spec` imports them)."""
    try:
        return all(importlib.util.find_spec(name) is not None for name in modules)
    except ModuleNotFoundError:  # a missing parent package
        return False


@pytest.fixture
def reports_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cuda_config_initialises_on_the_gpu_with_only_importable_fusions(reports_cuda: None) -> None:
    model = ModelConfig(activation="swiglu", position_embedding_type="rope", normalization="LayerNorm")
    config = build_transformer_config(model, MegatronConfig(tensor_model_parallel_size=2))
    assert not config.use_cpu_initialization, "on CUDA the weights must be drawn on the GPU"
    assert config.batch_p2p_comm
    # what is installed here, asked of Python's importer, not of the code under test: Megatron's torch-scripted
    # bias fusions always; the masked softmax from its CUDA extensions; the fused RoPE from Transformer Engine; the
    # gradient-accumulation fusion from apex's fused_weight_gradient_mlp_cuda (apex's persistent LayerNorm is never
    # chosen: the local spec's norms refuse it, the next test)
    installed = {
        "bias_activation_fusion": True, "bias_dropout_fusion": True,
        "masked_softmax_fusion": _importable("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
        "apply_rope_fusion": _importable("transformer_engine"),
        "gradient_accumulation_fusion": _importable("fused_weight_gradient_mlp_cuda"),
    }  # fmt: skip
    flags = {name: getattr(config, name) for name in FUSIONS}
    assert flags == installed, f"fusion flags {flags} differ from what is installed here {installed}"
    assert importable_fusions() == installed
    # this machine has neither Transformer Engine nor apex: only Megatron's torch-scripted fusions can be on
    assert not (config.apply_rope_fusion or config.gradient_accumulation_fusion or config.persist_layer_norm)
    assert config.bias_activation_fusion and config.bias_dropout_fusion


def test_with_every_kernel_importable_the_tiny_recipes_layer_norm_builds_on_cuda(reports_cuda: None) -> None:
    """The CUDA branch of the fusion choice on a machine where apex's and TE's kernels import: the tiny recipe's
    LayerNorm model on the local spec gets only flags its norms take (apex's persistent LayerNorm is not one)."""
    from megatron_ppo.config import load_config
    from megatron_ppo.models.kernels import fusion_flags
    from megatron_ppo.models.norms import LocalNorm

    model = load_config("recipes/tiny-cpu.yaml", ["model.params_dtype=fp32"]).model
    assert model.normalization == "LayerNorm" and model.transformer_impl != "transformer_engine"
    config = copy.copy(build_transformer_config(model, MegatronConfig()))
    flags = fusion_flags(model, importable=dict.fromkeys(FUSIONS, True))
    assert flags["gradient_accumulation_fusion"] and flags["bias_activation_fusion"]
    for name, on in flags.items():
        setattr(config, name, on)
    assert LocalNorm(config, model.hidden_size).normalized_shape == (model.hidden_size,)
    config.persist_layer_norm = True  # what the choice gave before: the local norm refuses it
    with pytest.raises(ValueError, match="persist_layer_norm"):
        LocalNorm(config, model.hidden_size)


def test_cuda_config_keeps_host_init_when_layout_independent_weights_are_asked_for(reports_cuda: None) -> None:
    model = ModelConfig(activation="gelu", add_bias_linear=False, use_cpu_initialization=True)
    config = build_transformer_config(model, MegatronConfig())
    assert config.use_cpu_initialization
    assert not config.bias_activation_fusion, "Megatron fuses GeLU only with a bias"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_is_refused_without_a_gpu_and_the_message_names_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.device=cpu"):
        select_device("cuda", local_rank=0)


def test_a_micro_batch_on_another_device_is_caught() -> None:
    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long, device="meta"), "labels": torch.zeros(2, 3)}
    with pytest.raises(RuntimeError, match=r"the actor model's forward: micro-batch tensors \{'input_ids': 'meta'\}"):
        to_device(batch, torch.device("cpu"), "the actor model's forward")


def test_host_tensors_reach_the_model_device_as_dense_copies_of_any_layout() -> None:
    """Every layout a batch can carry — expanded (stride 0, the cached decoder's positions), self-overlapping,
    strided, 0-d — arrives as a dense copy of the same values through the staging pinning uses (a buffer of the
    tensor's own strides), which is what the first CUDA run refused for the stride-0 positions."""
    base = torch.arange(24).view(4, 6)
    layouts = {
        "expanded": torch.arange(5).expand(3, 5),
        "overlapping": torch.arange(10).as_strided((4, 3), (1, 1)),
        "strided": base[:, ::2],
        "transposed": base.t(),
        "zero_dim": torch.tensor(7),
        "plain": base,
    }
    moved = to_device({**layouts, "note": "kept"}, torch.device("cpu"), "test")
    assert moved["note"] == "kept"
    for name, value in layouts.items():
        copy_ = moved[name]
        assert copy_ is not value and copy_.is_contiguous() and torch.equal(copy_, value), name
        assert copy_.untyped_storage().data_ptr() != value.untyped_storage().data_ptr(), f"{name}: not a copy"
    # the rule the staging enforces on the CPU as pinning does on CUDA: a buffer of an expanded tensor's own strides
    # cannot take its values
    expanded = layouts["expanded"]
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        torch.empty_strided(expanded.size(), expanded.stride(), dtype=expanded.dtype).copy_(expanded)


def test_a_model_on_another_device_than_the_run_is_caught() -> None:
    with pytest.raises(RuntimeError, match=r"parameters on \['meta'\], but this run computes on cpu"):
        module_device(torch.nn.Linear(2, 2, device="meta"), "the critic model")


def test_the_start_line_names_spec_attention_fusions_optimizer_and_dtype() -> None:
    config = PPOConfig(model=ModelConfig(params_dtype="fp32"))
    line = describe_kernels(config)
    for part in ("device cpu", "spec Megatron local", "scaled_dot_product_attention (flash, CPU kernel",
                 "fusions none", "optimizer torch AdamW", "dtype fp32", "sequences as padded rows"):  # fmt: skip
        assert part in line, f"{part!r} missing from {line!r}"
    config.model.pack_sequences = True
    assert "sequences packed (THD, one SDPA call per sequence)" in describe_kernels(config)


def kernel_sdpa_runs(model: ModelConfig) -> str:
    """The backend `scaled_dot_product_attention` really runs for `model`'s causal grouped-query attention on the
    CPU (query `[1, heads, 64, hn]`, keys `[1, groups, 64, hn]`), read from the profiler's op names."""
    kernels = {"aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
               "aten::_scaled_dot_product_attention_math": "math"}  # fmt: skip
    head_dim, dtype = model.hidden_size // model.num_attention_heads, DTYPES[model.params_dtype]
    query = torch.zeros(1, model.num_attention_heads, 64, head_dim, dtype=dtype)
    key = torch.zeros(1, model.num_query_groups, 64, head_dim, dtype=dtype)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        torch.nn.functional.scaled_dot_product_attention(query, key, key, is_causal=True, enable_gqa=True)
    (ran,) = {kernels[event.name] for event in profile.events() if event.name in kernels}
    return ran


def test_the_attention_kernel_named_is_the_one_sdpa_dispatches_to() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_ppo.models.kernels import sdpa_backend

    config = PPOConfig(model=ModelConfig(params_dtype="bf16", num_attention_heads=4, num_query_groups=2))
    # flash on the CPU at the lock's torch; math where CPU flash does not yet take grouped-query heads (torch 2.6)
    assert sdpa_backend(config) == kernel_sdpa_runs(config.model)
    with sdpa_kernel([SDPBackend.MATH]):  # the dispatcher's choice, not a guess: it follows what is enabled
        assert sdpa_backend(config) == sdpa_backend(config, masked=True) == "math"
        assert "scaled_dot_product_attention (math, CPU kernel; with a mask math)" in describe_kernels(config)


def test_data_parallel_communication_overlaps_on_both_devices() -> None:
    on_cpu = data_parallel_config(MegatronConfig(use_distributed_optimizer=True))
    assert on_cpu.overlap_grad_reduce and on_cpu.overlap_param_gather and on_cpu.use_distributed_optimizer
    assert not data_parallel_config(MegatronConfig()).overlap_param_gather, "param gather overlap needs the dist opt"


def test_cuda_max_connections_is_one_unless_the_user_set_it() -> None:
    environ: dict[str, str] = {}
    assert set_cuda_max_connections(environ) == "1"
    assert environ == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    mine = {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    assert set_cuda_max_connections(mine) == "8", "a value the user exported must be kept"
    assert mine == {"CUDA_DEVICE_MAX_CONNECTIONS": "8"}


def test_a_batch_off_the_run_device_is_refused_before_it_reaches_algo() -> None:
    """`forward_passes` and `compute_advantages` take the run's device only (a host batch on CUDA met device
    tensors deep inside the advantages), and say how to move the batch."""
    from megatron_ppo.config.schema import PPOConfig
    from megatron_ppo.train.experience import compute_advantages, forward_passes

    batch = {"input_ids": torch.zeros(2, 3, dtype=torch.long, device="meta"), "loss_mask": torch.ones(2, 3)}
    with pytest.raises(ValueError, match=r"forward_passes: tensors \{'input_ids': 'meta'\}.*to_device\(batch"):
        forward_passes(PPOConfig(), batch, None, None, None)
    with pytest.raises(ValueError, match=r"compute_advantages: tensors \{'old_log_prob': 'meta'\}"):
        compute_advantages(PPOConfig(), {"loss_mask": torch.ones(2, 3)}, {"old_log_prob": torch.zeros(2, 3,
                           device="meta")}, None, None)  # fmt: skip


def test_the_start_line_names_each_roles_spec_where_lora_makes_them_differ(monkeypatch) -> None:
    """Where Transformer Engine runs (`auto` on CUDA with TE), a LoRA actor and its reference (its own base) are built
    with the local spec and the critic with TE's: the line says so, the actor's attention named (it said "Transformer
    Engine" for every role)."""
    from megatron_ppo.models import kernels

    monkeypatch.setattr(kernels, "transformer_engine_usable", lambda: True)
    from megatron_ppo.config import load_config

    config = load_config("recipes/qwen2.5-32b-lora.yaml", ["critic.lora.rank=0"])
    assert kernels.role_specs(config) == {"actor": False, "reference": False, "critic": True}
    line = describe_kernels(config)
    assert "spec actor Megatron local, reference Megatron local, critic Transformer Engine (LoRA" in line, line
    assert "scaled_dot_product_attention" in line, "the actor's attention"
    assert "spec Megatron local;" in describe_kernels(load_config("recipes/qwen2.5-32b-lora.yaml")), "both LoRA"
    full = load_config("recipes/qwen2.5-32b.yaml")
    assert set(kernels.role_specs(full).values()) == {True}
    assert "spec Transformer Engine; attention TEDotProductAttention" in describe_kernels(full)
