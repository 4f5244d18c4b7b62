"""Spawned-rank code for the LoRA tests, on the small `transformers` models of `tests.support.hf_models`."""

from __future__ import annotations

import zlib

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_ppo.checkpoint import store
from megatron_ppo.checkpoint.run_identity import RunIdentity
from megatron_ppo.config.schema import ActorConfig, LoraSettings, MegatronConfig, PPOConfig
from megatron_ppo.convert.huggingface import hf_model_config
from megatron_ppo.models import build_role_model, run_micro_batches, unwrap
from megatron_ppo.models.gpt import base_reference
from megatron_ppo.models.lora import LoraColumnParallelLinear, LoraRowParallelLinear
from megatron_ppo.parallel import init_distributed
from megatron_ppo.parallel.ranks import is_first_of_last_stage


def _full_adapter(layer_number: int, target: str, rows: int, columns: int) -> torch.Tensor:
    """The whole (TP = 1) adapter matrix of one layer's target, drawn from its own seed: the same at any layout."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{layer_number}.{target}".encode()))
    return torch.randn(rows, columns, generator=generator) * 0.2


def fill_adapters(actor) -> None:
    """Give every adapter of this rank's shard its part of `_full_adapter`'s matrices (B ≠ 0, so the adapters change
    the model): a column-parallel layer's B by rows (of linear_fc1, each half's), a row-parallel layer's A by
    columns, as Megatron splits W."""
    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    for chunk in actor.chunks:
        for layer in unwrap(chunk).decoder.layers:
            for name, module in layer.named_modules():
                if not isinstance(module, (LoraColumnParallelLinear, LoraRowParallelLinear)):
                    continue
                target = name.rsplit(".", 1)[-1]
                rank = module.lora_A.weight.shape[0]
                a = _full_adapter(layer.layer_number, f"{target}.A", rank, module.input_size)
                b = _full_adapter(layer.layer_number, f"{target}.B", module.output_size, rank)
                if target == "linear_fc1":  # [gate; up]: a TP rank holds its rows of each half
                    b = torch.cat([half.chunk(tp)[tp_rank] for half in b.chunk(2)])
                elif isinstance(module, LoraColumnParallelLinear):
                    b = b.chunk(tp)[tp_rank]
                else:
                    a = a.chunk(tp, dim=1)[tp_rank]
                with torch.no_grad():
                    module.lora_A.weight.copy_(a)
                    module.lora_B.weight.copy_(b)


def save_random_adapters(rank: int, world_size: int, hf_dir: str, base_dir: str, out: str, lora: dict) -> str:
    """A LoRA actor on the converted base at `base_dir`, its adapters filled (`fill_adapters`), saved as a training
    run saves it (with a run.json naming the adapters' settings) under `out`."""
    init_distributed(MegatronConfig(), seed=0)
    settings = LoraSettings(**lora)
    actor = build_role_model("actor", hf_model_config(hf_dir), MegatronConfig(), lora=settings)
    store.load_weights(actor, base_dir, "actor")
    fill_adapters(actor)
    run = RunIdentity.of("lora-parity", PPOConfig(actor=ActorConfig(lora=settings)))
    return str(store.save_checkpoint(out, 1, {"actor": actor}, {}, {}, run=run))


def _logits(model, input_ids: torch.Tensor, vocab: int) -> torch.Tensor | None:
    def gather(batch, logits):
        return logits.new_zeros(()), {"logits": gather_from_tensor_model_parallel_region(logits)[..., :vocab]}

    outputs = run_micro_batches(model, [{"input_ids": input_ids}], gather, forward_only=True)
    return outputs[0]["logits"].float() if outputs and is_first_of_last_stage() else None


def logits_under(
    rank: int, world_size: int, hf_dir: str, checkpoint: str, lora: dict, layout: MegatronConfig, input_ids
) -> dict | None:
    """Under `layout`: the LoRA checkpoint's actor loaded (adapters and base), its logits with the adapters on and
    through its base reference (adapters off); None on ranks that do not report."""
    init_distributed(layout, seed=0)
    model = hf_model_config(hf_dir)
    actor = build_role_model("actor", model, layout, lora=LoraSettings(**lora))
    store.load_checkpoint(checkpoint, {"actor": actor}, {})
    ref = base_reference(actor)
    on, off = _logits(actor, input_ids, model.vocab_size), _logits(ref, input_ids, model.vocab_size)
    again = _logits(actor, input_ids, model.vocab_size)  # the adapters are back after the reference's pass
    return None if on is None else {"actor": on, "ref": off, "actor_again": again}


def verdicts(rank: int, world_size: int, checkpoint: str, hf_dirs: list[str]) -> list[tuple[bool, str]] | None:
    """`convert verify`'s verdict line for the checkpoint against each Hugging Face folder in turn (None on ranks
    that do not report)."""
    from megatron_ppo.convert.huggingface import verify

    init_distributed(MegatronConfig(), seed=0)
    found = [verify(hf_dir, checkpoint, MegatronConfig()) for hf_dir in hf_dirs]
    return None if found[0] is None else [verdict.line() for verdict in found]
