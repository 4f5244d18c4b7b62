"""Spawned-rank code for the conversion tests, on the small `transformers` models of `tests.support.hf_models`."""

from __future__ import annotations

from megatron_ppo.config import load_config
from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.convert import huggingface
from megatron_ppo.convert.huggingface import fill_from_hf, hf_model_config, hf_to_mcore
from megatron_ppo.models import build_role_model
from megatron_ppo.parallel import init_distributed
from megatron_ppo.train.run import train


def verify(hf_dir: str, megatron_dir: str, layout: MegatronConfig) -> float | None:
    """The largest logit difference `convert verify` finds (None on a rank that does not report)."""
    verdict = huggingface.verify(hf_dir, megatron_dir, layout)
    return None if verdict is None else verdict.difference


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
    """A checkpoint (dense or MoE) in one process: converted, its largest logit difference from `transformers`, and
    (bytes read, parameters held)."""
    init_distributed(MegatronConfig(), seed=0)
    megatron_dir = str(hf_to_mcore(hf_dir, f"{root}/megatron"))
    difference = verify(hf_dir, megatron_dir, MegatronConfig())
    return {"megatron": megatron_dir, "difference": difference, "reads": _reads(hf_dir, MegatronConfig())}


def saved_under(rank: int, world_size: int, hf_dir: str, out: str, layout: MegatronConfig) -> str:
    """The model saved by Megatron's distributed checkpointing from `layout`'s shards (as a training job at that
    layout saves its actor), through the conversion's build-fill-save."""
    init_distributed(layout, seed=0)
    return str(hf_to_mcore(hf_dir, out, layout=layout))


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


def train_recipe(rank: int, world_size: int, recipe: str, overrides: list[str]) -> int:
    """The trainer's whole path (`megatron_ppo.train.run.train`) on this recipe; the steps it ran."""
    return len(train(load_config(recipe, overrides)))
