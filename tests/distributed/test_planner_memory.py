"""The planner's memory model against the real model, in one 2-rank launch: the bytes a transformer layer saves for
its backward (`torch.autograd.graph.saved_tensors_hooks` on our GPTModel) against `layer_activation_bytes`, for no
/ selective / full recompute, at TP 2 with and without sequence parallelism, padded rows and packed sequences;
and the parameters each pipeline stage holds (the first the embedding, the last the output layer) against
`stage_parameters`, whose most loaded stage the planner reports."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_ppo.config.schema import MegatronConfig
from megatron_ppo.planner.plan import CPU_KERNELS, layer_activation_bytes, stage_parameters
from tests.distributed import planner_workers
from tests.distributed.harness import run_distributed
from tests.distributed.planner_workers import LENGTHS, MODEL, RECOMPUTE, ROWS, VARIANTS, WIDTH

LAYOUTS = {"tp2": MegatronConfig(tensor_model_parallel_size=2),
           "tp2-sp": MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)}  # fmt: skip
CASES = [("llama", name, recompute, packed) for name in LAYOUTS for recompute in RECOMPUTE for packed in (False, True)]
CASES += [(variant, "tp2-sp", None, False) for variant in ("qwen3", "gpt2")]


@pytest.fixture(scope="module")
def measured() -> list[dict]:
    return run_distributed(planner_workers.measure, 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(part) for part in c))
def test_a_layer_saves_what_the_planner_counts(measured: list[dict], case: tuple) -> None:
    """Within 1 % on every rank, well inside the issue's 15 %: the count is exact (to the byte without recompute or
    with full recompute, 4 bytes short with selective), and at these shapes a wrong term of one FFN width (f·e)
    is 11 % of a layer's bytes, which 15 % would let through."""
    variant, layout_name, recompute, packed = case
    model = dataclasses.replace(MODEL, **VARIANTS[variant])
    layout = dataclasses.replace(LAYOUTS[layout_name], **RECOMPUTE[recompute])
    tokens, rows = (sum(LENGTHS), 1) if packed else (ROWS * WIDTH, ROWS)
    planned = layer_activation_bytes(model, layout, tokens, rows, kernels=CPU_KERNELS, packed=packed)
    for rank, result in enumerate(measured):
        saved = result["activations"][case]
        assert saved == pytest.approx(planned, rel=0.01), f"rank {rank}: saved {saved} B, planned {planned:.0f} B"


@pytest.mark.parametrize(("layout_name", "role", "embeddings"), [
    ("tp2", "actor", "untied"), ("tp2", "critic", "untied"), ("pp2", "actor", "untied"), ("pp2", "critic", "untied"),
    ("pp2", "actor", "tied"), ("pp2-vpp2", "actor", "untied"), ("pp2-vpp2", "critic", "untied"),
])  # fmt: skip
def test_each_stage_holds_the_parameters_the_planner_counts(measured: list[dict], layout_name: str, role: str,
                                                           embeddings: str) -> None:  # fmt: skip
    """Exactly, rank by rank: TP splits the matrices (the vocabulary padded) and replicates the norms; the first
    pipeline stage holds the input embedding, the last the output layer (a copy of the tied embedding; the critic's
    value head) and the final norm."""
    tp = 2 if layout_name == "tp2" else 1
    layout = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1 if tp == 2 else 2,
                            virtual_pipeline_model_parallel_size=2 if layout_name == "pp2-vpp2" else None)  # fmt: skip
    model = dataclasses.replace(MODEL, num_layers=4, untie_embeddings_and_output_weights=embeddings == "untied")
    planned = [sum(stage) for stage in stage_parameters(model, layout, role)]
    if tp == 2:
        planned *= 2  # both TP ranks hold the one stage's shard
    held = [result["parameters"][layout_name, role, embeddings] for result in measured]
    assert held == planned
