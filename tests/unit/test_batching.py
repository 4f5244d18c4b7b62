"""Micro-batching by count and by token budget, and the epoch sampler's order, drops and exact resume."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from megatron_ppo.config import ConfigError, load_config
from megatron_ppo.config.frozen import with_changes
from megatron_ppo.data import EpochSampler, dynamic_micro_batches, fixed_micro_batches, padding_fraction
from megatron_ppo.data.batching import GroupSampler, group_rows
from megatron_ppo.data.rows import Row
from megatron_ppo.train.batch import build_sampler


def _skewed_lengths(n: int = 256, seed: int = 0) -> list[int]:
    """90 % short rows (15–25 tokens), 10 % long ones (450–550), in random order."""
    rng = random.Random(seed)
    num_long = n // 10
    lengths = [rng.randint(450, 550) for _ in range(num_long)] + [rng.randint(15, 25) for _ in range(n - num_long)]
    rng.shuffle(lengths)
    return lengths


def test_fixed_micro_batches_are_consecutive_groups_in_order() -> None:
    assert fixed_micro_batches([5] * 7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_micro_batches([], 3) == []


def test_padding_fraction_is_the_share_of_padded_positions() -> None:
    assert padding_fraction([2, 4, 3], [[0, 1], [2]]) == pytest.approx(1 - 9 / (2 * 4 + 3))
    assert padding_fraction([5, 5], [[0, 1]]) == 0.0


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_micro_batches_respect_the_budget_and_cover_each_index_once(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 200))]
    micro_batches = dynamic_micro_batches(lengths, 1024)
    assert all(len(mb) * max(lengths[i] for i in mb) <= 1024 for mb in micro_batches)
    assert sorted(i for mb in micro_batches for i in mb) == list(range(len(lengths)))
    assert micro_batches == dynamic_micro_batches(list(lengths), 1024), "deterministic"


def test_dynamic_micro_batches_pad_far_less_than_fixed_ones_on_skewed_lengths() -> None:
    lengths = _skewed_lengths()
    budget = 2048
    dynamic = dynamic_micro_batches(lengths, budget)
    # The largest fixed size that can never exceed the budget: 3 rows of up to 550 tokens.
    fixed = fixed_micro_batches(lengths, budget // max(lengths))
    # Measured: dynamic ≈ 0.10 in 11 micro-batches, fixed ≈ 0.56 in 86.
    assert padding_fraction(lengths, dynamic) < 0.15
    assert padding_fraction(lengths, fixed) > 0.5
    assert len(dynamic) < len(fixed) / 4


def test_a_sequence_longer_than_the_budget_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"sequence 1 has 600 tokens, .*max_tokens=512"):
        dynamic_micro_batches([10, 600, 20], 512)


def _draw(sampler: EpochSampler, batch_size: int, count: int) -> list[list[int]]:
    return [sampler.next_batch(batch_size) for _ in range(count)]


def test_sampler_order_is_fixed_by_seed_and_changes_with_seed_and_epoch() -> None:
    first = _draw(EpochSampler(100, seed=3), 50, 4)
    assert first == _draw(EpochSampler(100, seed=3), 50, 4)
    next_seed = _draw(EpochSampler(100, seed=4), 50, 4)
    assert first != next_seed
    assert first[2:] != next_seed[:2], "seed 4 does not replay seed 3 one epoch behind"
    epoch0, epoch1 = first[0] + first[1], first[2] + first[3]
    assert sorted(epoch0) == sorted(epoch1) == list(range(100))
    assert epoch0 != epoch1
    assert epoch0 != list(range(100)), "shuffled"


def test_sampler_without_shuffle_goes_in_order() -> None:
    assert _draw(EpochSampler(5, seed=0, shuffle=False), 2, 3) == [[0, 1], [2, 3], [0, 1]]


def test_batches_never_straddle_epochs_and_the_leftover_is_counted() -> None:
    sampler = EpochSampler(10, seed=0)
    batches = _draw(sampler, 4, 4)
    assert (sampler.epoch, sampler.position, sampler.dropped_last) == (1, 8, 2)
    for epoch_batches in (batches[:2], batches[2:]):
        seen = epoch_batches[0] + epoch_batches[1]
        assert len(set(seen)) == 8, "two batches of one epoch never repeat a row"
    assert set(batches[0] + batches[1]) != set(batches[2] + batches[3]), "each epoch drops its own last rows"


def test_a_resumed_sampler_draws_exactly_what_an_uninterrupted_one_would() -> None:
    uninterrupted = _draw(EpochSampler(10, seed=7), 3, 8)
    before = EpochSampler(10, seed=7)
    _draw(before, 3, 4)  # three batches of epoch 0, then one of epoch 1
    state = before.state_dict()
    assert (state["epoch"], state["position"]) == (1, 3)
    resumed = EpochSampler(10, seed=7)
    resumed.load_state_dict(state)
    assert _draw(resumed, 3, 4) == uninterrupted[4:], "mid-epoch 1, then across into epoch 2"
    assert resumed.dropped_last == 2 and resumed.epoch == 2


def test_a_sampler_state_from_another_dataset_is_refused() -> None:
    state = EpochSampler(10, seed=7).state_dict()
    with pytest.raises(ValueError, match="num_rows=10"):
        EpochSampler(11, seed=7).load_state_dict(state)


def test_group_sampler_draws_whole_groups_and_resumes_exactly() -> None:
    groups = [[3 * g, 3 * g + 1, 3 * g + 2] for g in range(10)]
    sampler = GroupSampler(groups, seed=4)
    owner = {row: g for g, group in enumerate(groups) for row in group}
    drawn = [sampler.next_batch(9) for _ in range(3)]
    for batch in drawn:
        assert len(batch) == 9
        assert all(sorted(batch[i : i + 3]) == groups[owner[batch[i]]] for i in range(0, 9, 3)), batch
    # 10 groups, 3 per batch: the 4th batch starts epoch 1 and the 1 group left over is dropped (3 rows)
    state = sampler.state_dict()
    fourth = sampler.next_batch(9)
    assert (sampler.epoch, sampler.dropped_last) == (1, 3)
    resumed = GroupSampler(groups, seed=4)
    resumed.load_state_dict(state)
    assert resumed.next_batch(9) == fourth
    with pytest.raises(ValueError, match="not a multiple of the group size 3"):
        sampler.next_batch(8)


def test_group_rows_keeps_the_common_size_and_counts_what_it_leaves_out() -> None:
    uids = ["a", "b", "a", "b", "c", "a", "b", "d", "d"]
    grouping = group_rows(uids)
    assert (grouping.groups, grouping.group_size) == ([[0, 2, 5], [1, 3, 6]], 3)
    assert grouping.left_out == [[4], [7, 8]] and grouping.singleton_rows == 1
    sources = [f"data.jsonl:{i + 1}" for i in range(len(uids))]
    assert grouping.summary(sources) == (
        "grpo: 2 groups of 3 rows; 2 groups of another size (3 rows) left out, e.g. the group of data.jsonl:5 "
        "(1 rows); 1 rows alone in their group"
    )


def _rows(uids: list[str]) -> list[Row]:
    return [Row([5, 6], [7], 1.0, None, None, uid, "test", f"data.jsonl:{i + 1}") for i, uid in enumerate(uids)]


def test_grpo_sampling_refuses_singleton_data_and_a_batch_that_would_split_groups() -> None:
    tiny = Path(__file__).resolve().parents[2] / "recipes" / "tiny-cpu.yaml"
    sizes = [f"{role}.{key}" for role in ("actor", "critic")
             for key in ("ppo_mini_batch_size=8", "ppo_micro_batch_size_per_gpu=4")]  # fmt: skip
    config = load_config(tiny, ["algorithm.adv_estimator=grpo", "data.train_batch_size=8", *sizes])
    with pytest.raises(ConfigError, match=r"grpo: 6 groups of 1 rows.*6 rows alone in their group — it compares"):
        build_sampler(config, _rows(["a", "a", *"bcdefg"]))
    with pytest.raises(ConfigError, match=r"train_batch_size=8: grpo draws whole groups of 3 rows.* e\.g\. 6 or 9"):
        build_sampler(config, _rows([u for u in "abcd" for _ in range(3)]))
    config = with_changes(config, {"data.train_batch_size": 6})
    sampler, sampled, line = build_sampler(config, _rows([*(u for u in "abcd" for _ in range(3)), "e"]))
    assert (sampled, line) == (12, "grpo: 4 groups of 3 rows; 1 groups of another size (1 rows) left out, e.g. the "
                                    "group of data.jsonl:13 (1 rows); 1 rows alone in their group")  # fmt: skip
    batch = sampler.next_batch(6)
    assert len(batch) == 6 and {i // 3 for i in batch[:3]} != {i // 3 for i in batch[3:]}
    assert all(len({i // 3 for i in batch[k : k + 3]}) == 1 for k in (0, 3)), f"groups split: {batch}"


@pytest.mark.parametrize("seed", range(5))
def test_dynamic_micro_batches_cut_to_a_given_count_stay_in_budget(seed: int) -> None:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 300) for _ in range(rng.randint(8, 60))]
    packed = dynamic_micro_batches(lengths, 1024)
    for count in sorted({len(packed), len(packed) + 1, -(-len(packed) // 4) * 4, len(lengths)}):
        micro_batches = dynamic_micro_batches(lengths, 1024, count=count)
        assert len(micro_batches) == count and all(micro_batches)
        assert all(len(mb) * max(lengths[i] for i in mb) <= 1024 for mb in micro_batches)
        assert sorted(i for mb in micro_batches for i in mb) == list(range(len(lengths)))


def test_a_count_beyond_the_rows_or_below_the_packing_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot cut 3 rows into 4 micro-batches"):
        dynamic_micro_batches([10, 20, 30], 100, count=4)
    with pytest.raises(ValueError, match=r"cannot cut 3 rows into 1 micro-batches .*packs them into 2"):
        dynamic_micro_batches([10, 20, 30], 40, count=1)
