"""Actor and critic under TP, TP with sequence parallelism (odd micro-batch widths: padded to a multiple of TP and
cut back; and bucketed to a multiple of 16), full and selective activation recompute, PP, TP×PP, PP with virtual
stages, and DP, against the same weights at TP=1 PP=1, through the trainer's own experience and update path
(`forward_passes`, `update_role`, `actor_loss`, `critic_loss`); with token-budget micro-batches (use_dynamic_bsz)
under virtual stages and DP, where the replicas' own packings give different counts, which the interleaved
schedule refuses unless they are evened out to a multiple of PP; then GSPO with sequence-level importance weights
(`rollout_correction`), whose ratios and weights are per whole row. Pipeline passes send one shape each, with no
shape exchange."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_ppo.config.schema import MegatronConfig
from tests.distributed import workers
from tests.distributed.harness import run_distributed
from tests.distributed.parity_checks import (
    assert_experience_matches,
    assert_grad_norms_and_weights_match,
    assert_update_metrics_match,
)

LAYOUTS = {
    "tp2": (2, MegatronConfig(tensor_model_parallel_size=2)),
    "tp2-sp": (2, MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
    "tp2-sp-recompute-full": (
        2,
        MegatronConfig(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=1,
        ),
    ),
    "pp2-recompute-selective": (2, MegatronConfig(pipeline_model_parallel_size=2, recompute_granularity="selective")),
    "pp2": (2, MegatronConfig(pipeline_model_parallel_size=2)),
    "pp2-vpp2": (2, MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    # widths bucketed to 16 (the rows hold 6–12 tokens): lcm with TP under SP, one shape per pipeline pass
    "tp2-sp-bucket16": (
        2,
        MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True, make_sequence_length_divisible_by=16),
    ),
    "dp2-distopt": (2, MegatronConfig(use_distributed_optimizer=True)),
    "tp2-pp2": (4, MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
    "pp2-vpp2-dp2-dynamic": (4, MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    "pp2-vpp2-dynamic": (2, MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)),
    # packed sequences (model.pack_sequences, THD) against the padded reference: each sequence padded to a multiple
    # of TP under SP; the pipeline passes one [1, T] shape each, also with the token budget of pp2-vpp2-dynamic
    "tp2-sp-packed": (2, MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True)),
    "pp2-packed": (2, MegatronConfig(pipeline_model_parallel_size=2)),
    "pp2-vpp2-dynamic-packed": (
        2,
        MegatronConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    ),
}
PACKED = {name for name in LAYOUTS if name.endswith("-packed")}
# Token budgets (use_dynamic_bsz) under virtual stages: with DP 2 the replicas' rows (6–12 tokens) pack into counts
# that both replicas even out to the larger, a multiple of PP (an odd count is refused by Megatron). Without DP, the
# 8 rows at 30 tokens pack into (2, 12), (2, 11), (3, 10), (1, 6): no one shape holds them within the budget, so the
# interleaved schedule exchanges shapes (waited for per call, that deadlocked out-of-step stages at TP 2 on gloo,
# see `models.transformer_config.build_transformer_config`).
MAX_TOKENS = {"pp2-vpp2-dp2-dynamic": 18, "pp2-vpp2-dynamic": 30, "pp2-vpp2-dynamic-packed": 30}


# The layouts the floor leg (`make test-floor`, the oldest megatron-core admitted) also runs.
FLOOR_LAYOUTS = {"tp2", "pp2", "pp2-vpp2-dynamic"}  # the last: Megatron's shape exchange under virtual stages


def layouts(names) -> list:
    return [pytest.param(name, marks=[pytest.mark.floor] if name in FLOOR_LAYOUTS else []) for name in names]


def _selected_layouts(request: pytest.FixtureRequest) -> list[str]:
    wanted = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if item.module is request.module and callspec is not None:
            wanted |= {callspec.params[key] for key in ("name", "without", "padded") if key in callspec.params}
    return [name for name in LAYOUTS if name in wanted]


@pytest.fixture(scope="module")
def parity(request, tmp_path_factory) -> dict:
    """Every selected layout's update against the single-process reference: one launch per world size, re-laid out
    between layouts (only the layouts some selected test asks for: `-m floor` runs two)."""
    names = _selected_layouts(request)
    workdir = tmp_path_factory.mktemp("parity")
    # sequence_level: a second actor update with GSPO and sequence-level importance weights, one ratio per whole row
    run_distributed(workers.reference, 1, str(workdir), workers.MODEL, True)
    reports = workers.run_layouts(run_distributed, str(workdir), {name: LAYOUTS[name] for name in names}, MAX_TOKENS,
                                  workers.MODEL, sequence_level=True, packed=PACKED)  # fmt: skip
    weights = run_distributed(workers.compare_updated_weights, 1, str(workdir), names)[0]
    return {"reports": reports, "weights": weights, "workdir": Path(workdir)}


@pytest.mark.parametrize("name", layouts(LAYOUTS))
def test_experience_matches_single_process_on_every_rank(parity, name: str) -> None:
    assert_experience_matches(parity["reports"][name], name, "TP=1")


@pytest.mark.parametrize("name", layouts(LAYOUTS))
def test_update_metrics_match_single_process_on_every_rank(parity, name: str) -> None:
    required = {"actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/pg_clipfrac", "critic/vf_loss",
                "gspo:actor/pg_loss", "gspo:actor/pg_clipfrac", "gspo:actor/ppo_kl"}  # fmt: skip
    assert_update_metrics_match(parity["reports"][name], name, required)


@pytest.mark.parametrize("name", layouts(LAYOUTS))
def test_grad_norm_and_updated_weights_match_single_process(parity, name: str) -> None:
    assert_grad_norms_and_weights_match(parity, name)


@pytest.mark.parametrize(("name", "without"), [("tp2-sp", "tp2")])
def test_sequence_parallel_splits_micro_batches_over_tp_padding_odd_widths(parity, name: str, without: str) -> None:
    """Under sequence parallelism the decoders take each micro-batch's sequence split over the TP ranks, `[s/TP, b,
    h]`, its width padded to a multiple of TP; without it, the whole widths, some odd here (rows of 6–12 tokens in
    micro-batches of 2), so the padding is exercised. That these runs equal TP=1: the parity tests above."""

    def widths(layout: str) -> list[list[int]]:  # the sequence lengths entering the decoders, pass by pass (rank 0)
        passes = parity["reports"][layout][0]["pipeline_passes"]
        return [sorted({shape[0] for shape in seen["shapes"]}) for seen in passes]

    whole, split = widths(without), widths(name)
    assert any(width % 2 for pass_widths in whole for width in pass_widths), f"{without}: no odd width to pad: {whole}"
    assert split == [sorted({-(-width // 2) for width in pass_widths}) for pass_widths in whole], (whole, split)


@pytest.mark.parametrize(
    ("name", "without", "recomputed"),
    [("tp2-sp-recompute-full", "tp2-sp", "layer"), ("pp2-recompute-selective", "pp2", "core_attention")],
)
def test_activation_recompute_runs_the_forward_again_in_the_backward(
    parity, name: str, without: str, recomputed: str
) -> None:
    ours, plain = (parity["reports"][layout][0]["actor_first_layer_forwards"] for layout in (name, without))
    assert ours[recomputed] > plain[recomputed], f"{name}: no {recomputed} forward was recomputed ({ours} vs {plain})"
    if recomputed == "core_attention":
        assert ours["layer"] == plain["layer"], f"{name}: selective recompute reran whole layers ({ours} vs {plain})"


@pytest.mark.parametrize("name", layouts(["pp2", "pp2-vpp2", "tp2-pp2"]))
def test_value_head_lives_only_on_the_last_stage(parity, name: str) -> None:
    for report in parity["reports"][name]:
        assert report["value_head_on_this_rank"] == report["last_stage"]


@pytest.mark.parametrize("name", layouts(["pp2", "pp2-vpp2", "tp2-pp2", "pp2-vpp2-dp2-dynamic", "pp2-vpp2-dynamic"]))
def test_pipeline_passes_send_one_shape_without_a_shape_exchange(parity, name: str) -> None:
    """Fixed micro-batches: every pass one padded shape, `variable_seq_lengths` off (no shape exchange before each
    pipeline message); token budgets: a pass keeps its shapes (and the exchange) only where one would exceed them."""
    for rank, report in enumerate(parity["reports"][name]):
        passes = report["pipeline_passes"]
        assert len(passes) >= 5, f"{name}, rank {rank}: expected the experience and update passes, saw {passes}"
        for seen in passes:
            if not seen["variable_seq_lengths"]:
                assert len(seen["shapes"]) == 1, f"{name}, rank {rank}: one pass, several shapes {seen['shapes']}"
        if name not in MAX_TOKENS:
            assert not any(seen["variable_seq_lengths"] for seen in passes), f"{name}, rank {rank}: {passes}"


@pytest.mark.parametrize("name", ["pp2-packed", "pp2-vpp2-dynamic-packed"])
def test_packed_pipeline_passes_send_one_pack_shape_without_a_shape_exchange(parity, name: str) -> None:
    """Packed, every pass is one `[T, 1, h]` shape with `variable_seq_lengths` off — also under the token budget
    whose padded passes keep several shapes and exchange them (pp2-vpp2-dynamic)."""
    for rank, report in enumerate(parity["reports"][name]):
        passes = report["pipeline_passes"]
        assert len(passes) >= 5, f"{name}, rank {rank}: expected the experience and update passes, saw {passes}"
        for seen in passes:
            assert not seen["variable_seq_lengths"], f"{name}, rank {rank}: a packed pass exchanged shapes: {seen}"
            assert len(seen["shapes"]) == 1, f"{name}, rank {rank}: one pass, several shapes {seen['shapes']}"
            ((_, rows, _),) = seen["shapes"]
            assert rows == 1, f"{name}, rank {rank}: a packed pass sent {rows} rows, not one pack"
        assert report["pass_notes"] == [  # the log line that names each role's passes
            f"{role} passes: packed sequences [1, T] (THD); one shape per pipeline pass (variable_seq_lengths off)"
            for role in ("actor", "critic", "ref")
        ], report["pass_notes"]


@pytest.mark.parametrize(("name", "padded"), [("pp2-packed", "pp2"), ("pp2-vpp2-dynamic-packed", "pp2-vpp2-dynamic")])
def test_packed_rope_takes_per_token_angles_on_every_stage_and_chunk(parity, name: str, padded: str) -> None:
    """Packed, every chunk of every pipeline stage rotates its pack by per-token angles (`freqs[position_ids]`,
    `megatron_compat.rotary_per_token`: no per-sequence loop, no host read); padded rows by Megatron's table of the
    longest row (packed=False). That either equals the single-process reference: the parity tests above."""
    for layout, packed in ((name, True), (padded, False)):
        for rank, report in enumerate(parity["reports"][layout]):
            seen = report["rope_angles_per_token"]  # chunk → {(packed, one angle row per token)}
            assert len(seen) == report["chunks"], f"{layout}, rank {rank}: RoPE ran on chunks {sorted(seen)}"
            assert all(kinds == {(packed, True)} for kinds in seen.values()), f"{layout}, rank {rank}: {seen}"


@pytest.mark.parametrize(("name", "padded"), [("tp2-sp-packed", "tp2-sp"), ("pp2-packed", "pp2")])
def test_packing_computes_fewer_tokens_than_padding(parity, name: str, padded: str) -> None:
    """The same rows and micro-batches of 2 rows: packed, the model computed each sequence rounded up to an even
    length under TP 2 with SP, nothing more; with PP every pack of a pass has the pass's largest length. Either
    way fewer tokens than the padded rows."""
    computed, real = parity["reports"][name][0]["actor_tokens"]
    assert computed < parity["reports"][padded][0]["actor_tokens"][0], f"{name}: no fewer tokens than {padded}"
    if name == "tp2-sp-packed":
        lengths = workers.experience(workers.ROWS, seed=3)["lengths"].tolist()
        passes = real // sum(lengths)  # the actor's passes over the 8 rows: experience, update, GSPO update
        assert real == passes * sum(lengths), f"{name}: {real} real tokens in {passes} passes of {sum(lengths)}"
        assert computed == passes * sum(-(-length // 2) * 2 for length in lengths), f"{name}: computed {computed}"


@pytest.mark.parametrize(("name", "without"), [("tp2-sp-bucket16", "tp2-sp")])
def test_bucketed_widths_pad_the_model_inputs(parity, name: str, without: str) -> None:
    """The bucket layout's metrics match (the tests above); here: its model did compute the padded widths."""
    bucketed, plain = (parity["reports"][layout][0]["actor_tokens_computed"] for layout in (name, without))
    assert bucketed > plain, f"bucketing to 16 computed {bucketed} tokens, no more than TP's multiple ({plain})"
    assert bucketed % 16 == 0, f"{bucketed} tokens: not whole rows of a multiple of 16"


@pytest.mark.parametrize("name", layouts(LAYOUTS))
def test_reference_model_is_frozen_through_training(parity, name: str) -> None:
    for report in parity["reports"][name]:
        assert report["ref_has_no_grad"], f"{name}: a reference parameter requires grad"
        assert report["ref_weights_unchanged"], f"{name}: reference weights changed during the actor's step"


@pytest.mark.parametrize("layout", [MegatronConfig(tensor_model_parallel_size=2), MegatronConfig()], ids=["tp2", "dp2"])
def test_nan_gradient_on_one_rank_skips_the_step_everywhere(layout: MegatronConfig) -> None:
    for rank, report in enumerate(run_distributed(workers.nan_gradient_is_skipped, 2, layout)):
        assert report["poisoned_skipped"] and not math.isfinite(report["poisoned_norm"]), f"rank {rank}: {report}"
        assert report["weights_unchanged"], f"rank {rank}: a NaN step changed the weights"
        assert not report["clean_skipped"] and math.isfinite(report["clean_norm"]), f"rank {rank}: {report}"
        assert report["weights_changed_after"], f"rank {rank}: training did not continue after the skipped step"
