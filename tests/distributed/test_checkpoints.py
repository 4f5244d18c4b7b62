"""Checkpoints are published atomically, an unfinished or broken one is never resumed from, old ones are pruned."""

from __future__ import annotations

import pytest

from megatron_ppo.config.schema import MegatronConfig
from tests.distributed import checkpoint_workers
from tests.distributed.harness import run_distributed

# Also run against the oldest megatron-core admitted (`make test-floor`).
pytestmark = pytest.mark.floor


def test_resume_skips_unfinished_and_broken_checkpoints(tmp_path) -> None:
    report = run_distributed(checkpoint_workers.publish_and_recover, 1, str(tmp_path))[0]
    assert report["after_two_saves"] == "step_2"
    assert report["with_a_half_written_save"] == "step_2", "a .tmp save must never be resumed from"
    assert report["restored_step"] == 2 and report["weights_restored"]
    assert report["with_step_2_broken"] == "step_1", "latest names a broken checkpoint: fall back to the previous one"
    # keep=1 prunes complete checkpoints only; the broken step_2 is left for a person to inspect
    assert report["kept_after_prune"] == ["step_2", "step_4"]
    assert report["set_aside_after_prune"] == [], "a synchronous save deletes what it pruned"
    # checkpoints set aside for deletion are never resumed from, complete or half deleted; the next save deletes them
    assert report["with_set_aside_copies"] == ("step_4", ["step_4"])
    assert report["set_aside_after_save_5"] == []
    # Megatron's writer would otherwise start a Manager server process (a second copy of the program) per rank
    assert report["processes_started"] == [], report["processes_started"]


def test_a_second_run_in_the_same_directory_neither_prunes_nor_is_pruned_by_the_first(tmp_path) -> None:
    """The issue's 6-step/3-step case: pruning by step number deleted run B's newest checkpoint (`latest` then named
    a deleted directory and a resume fell back to run A's step_6)."""
    report = run_distributed(checkpoint_workers.two_runs_in_one_directory, 1, str(tmp_path))[0]
    # each run keeps its own newest two; latest names B's step_3
    assert report["shared"] == {"step_2": "run-b", "step_3": "run-b", "step_4": "run-a", "step_6": "run-a",
                                "latest": "step_3"}  # fmt: skip
    assert report["resumable"] == ("step_3", "run-b")
    # after resuming from step_2, the abandoned step_4 goes first; step_2 and the new step_3 stay
    assert report["branch"] == {"step_2": "run-a", "step_3": "run-a", "latest": "step_3"}
    listing, hidden, resaved = report["saved_again"]
    assert (listing, hidden, resaved) == (report["branch"], [], True), "saving the named step again"
    assert report["restored"] == ("step_3", True, None), "a save killed mid-replace is undone at the next start"


def test_a_run_starts_only_where_no_other_run_has_checkpoints(tmp_path) -> None:
    ranks = run_distributed(checkpoint_workers.start_rules, 2, str(tmp_path))
    assert ranks[0] == ranks[1], "every rank must receive rank 0's decision"
    report, ckpt = ranks[0], tmp_path / "ckpt"
    first_id, resume_from, log_dir, messages = report["first"]
    assert resume_from is None and log_dir == str(tmp_path / "tb" / first_id) and f"new run {first_id}" in messages[0]
    refusal = report["refused"]
    for part in (f"trainer.default_local_dir='{ckpt}' holds checkpoints of another run", f"run {first_id}: step_4",
                 "trainer.resume_mode=auto", "another trainer.default_local_dir",
                 f"trainer.overwrite=true to move them aside into {ckpt}/moved-aside/"):  # fmt: skip
        assert part in refusal, f"{part!r} missing from the refusal:\n{refusal}"
    assert report["after_refusal"] == {"step_4": first_id, "step_6": first_id, "latest": "step_6"}
    run_id, source, log_dir, messages = report["resumed"]
    assert (run_id, source, log_dir) == (first_id, "step_6", str(tmp_path / "tb" / first_id))
    assert f"resumed from {ckpt}/step_6 (named by {ckpt}/latest): run {first_id} continues" == messages[0]
    assert "in 1 key(s): actor.optim.lr: 1e-06 → 0.002" in messages[1], messages
    assert messages[2] == ("changed since the checkpoint (keys meant to change): trainer.exit_interval: None → 3; "
                           "trainer.resume_mode: 'disable' → 'auto'")  # fmt: skip
    run_id, source, messages, before_load, listing = report["older"]
    assert before_load == "step_6", "latest moves only once the checkpoint has loaded"
    assert (run_id, source, listing["latest"]) == (first_id, "step_4", "step_4"), "latest follows the resumed run"
    run_id, source, messages, listing, moved = report["fresh"]
    assert run_id != first_id and source is None and listing == {"latest": None}
    assert [entries for _, entries in moved] == [{"step_4": first_id, "step_6": first_id, "latest": "step_4"}]
    assert f"moved latest, step_4, step_6 aside into {ckpt}/moved-aside/{moved[0][0]}" in messages[1]
    run_id, source, listing, moved_now = report["mixed"]
    assert (run_id, source, listing) == (first_id, "step_6", {"step_6": first_id, "latest": "step_6"})
    assert moved_now == [{"step_1": report["fresh"][0], "latest": None}], "only the other run's checkpoint moves"
    assert "holds no run identity" in report["no_identity"] and "model.init_checkpoint=" in report["no_identity"]
    refusal = report["auto_without_identity"]
    assert "(saved without a run id: step_1)" in refusal, refusal
    assert "trainer.resume_mode=disable trainer.overwrite=true" in refusal, refusal


def test_local_checkpoint_loads_into_a_transformer_engine_model_but_a_missing_weight_fails(tmp_path) -> None:
    report = run_distributed(checkpoint_workers.local_checkpoint_into_extra_state_model, 1, str(tmp_path))[0]
    assert report["extra_state_keys"] > 0, "the stand-in TE model must ask for _extra_state entries"
    assert report["weights_loaded"], "the local checkpoint's weights must load into the TE-like model"
    error = report["missing_weight_error"]
    assert error is not None and "decoder.final_layernorm.extra_weight" in error, f"missing weight not named: {error}"


RESUME_LAYOUTS = {
    "tp2": (MegatronConfig(tensor_model_parallel_size=2), None),
    "pp2-distopt": (MegatronConfig(pipeline_model_parallel_size=2, use_distributed_optimizer=True), None),
    "dp2-distopt": (MegatronConfig(use_distributed_optimizer=True), None),
    # LoRA: the adapters (sharded by TP, sequence parallel) and their Adam states come back from the checkpoint
    "tp2-sp-lora": (MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True), {"rank": 4, "alpha": 8.0}),
    "dp2-distopt-lora": (MegatronConfig(use_distributed_optimizer=True), {"rank": 4, "alpha": 8.0}),
}


@pytest.mark.parametrize("layout", list(RESUME_LAYOUTS))
def test_a_resumed_optimizer_takes_the_same_next_update_bit_for_bit(tmp_path, layout: str) -> None:
    """The update after a resume equals the uninterrupted one exactly: same metrics, same weights after it (Adam's
    moments, step counts and the distributed optimizer's main weights all restored; with LoRA, the adapters')."""
    reports = run_distributed(checkpoint_workers.resumed_optimizer_takes_the_same_step, 2, str(tmp_path),
                              *RESUME_LAYOUTS[layout])  # fmt: skip
    for rank, report in enumerate(reports):
        assert report["resumed"] == report["uninterrupted"], (layout, rank, report)
        assert report["largest_weight_difference"] == 0.0, (layout, rank, report["largest_weight_difference"])


@pytest.mark.parametrize("layout", ["tp2", "dp2-distopt"])
def test_a_run_resumed_with_another_learning_rate_loads_and_steps_at_the_new_rate(tmp_path, layout: str) -> None:
    """`optim.lr` changed on resume (the run's start lists it): the optimizer loads — megatron-core 0.19 looked the
    saved groups up by their old `max_lr` and stopped — and its next step is twice the uninterrupted one at twice the
    rate (AdamW's step is proportional to lr), the groups and the schedule at the config's rate; a changed Adam β₂ is
    the config's too."""
    reports = run_distributed(checkpoint_workers.resumed_at_another_learning_rate, 2, str(tmp_path),
                              RESUME_LAYOUTS[layout][0])  # fmt: skip
    for report in reports:
        assert report["max_lr"] == [2e-2] and report["lr"] == [2e-2] and report["scheduler_max_lr"] == 2e-2, report
        assert report["largest_step"] > 1e-3, report  # the step moved the weights: the comparison is not vacuous
        assert report["largest_difference_from_twice"] <= 1e-6, report
        assert report["betas"] == [(0.9, 0.95)], report  # the config's Adam β₂, not the saved 0.999


def test_damaged_checkpoints_are_named_skipped_and_never_pruned_into_the_only_ones(tmp_path) -> None:
    """A checkpoint is trusted when its files match the manifest written at save: `auto` falls back past a damaged
    one and says why, `resume_path` to it is refused with `latest` unchanged, pruning never counts it, a load that
    still fails names the checkpoint, and a run id that is a path is refused."""
    ranks = run_distributed(checkpoint_workers.damaged_checkpoints, 2, str(tmp_path))
    report, ckpt = ranks[0], tmp_path / "ckpt"
    assert "trainer_state.pt" in report["manifest"] and "run.json" in report["manifest"]
    assert report["damage"].startswith("1 of its ") and "bytes, " in report["damage"], report["damage"]
    source, message, to_name, latest = report["auto"]
    assert (source, to_name, latest) == ("step_4", "step_4", "step_6"), "latest moves only once step_4 has loaded"
    assert f"(its newest complete checkpoint; skipped step_6, which latest named: {report['damage']})" in message
    refusal, latest = report["resume_path"]
    assert f"checkpoint {ckpt}/step_6 is damaged: 1 of its" in refusal and latest == "step_6", refusal
    assert report["after_prune"] == ["latest", "step_4", "step_6", "step_8"]
    assert f"{ckpt}/step_4 cannot be read (trainer_state.pt: " in report["load"], report["load"]
    assert "names the run '../../escaped', which is no run id" in report["escape"] and report["outside"] == []


def test_a_file_overwritten_in_place_is_refused_by_its_digest_and_the_run_resumes_from_the_one_before(
    tmp_path,
) -> None:
    """Every file's xxh3-64 digest is in the manifest — the shards' computed by each rank's asynchronous writer — and
    a file of any kind overwritten at its own size (bit rot, a bad copy, another job's write) makes `auto` skip the
    checkpoint with a line naming the file and resume from the one before; `resolve` with `prove` (export,
    `resume_from_path`) refuses it naming the file."""
    ranks = run_distributed(checkpoint_workers.corrupted_in_place, 2, str(tmp_path))
    report = ranks[0]
    manifest = report["manifest"]
    assert sorted(manifest["xxh3_64"]) == sorted(manifest["files"]), "every file has its digest"
    assert all(len(digest) == 16 for digest in manifest["xxh3_64"].values())
    shards = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    written = report["writers"]
    assert sorted(written) == ["digests_rank0.json", "digests_rank1.json"], written
    assert sorted(name for names in written.values() for name in names if name.endswith(".distcp")) == shards
    assert "trainer_state.pt" in written["digests_rank0.json"] and "rng_rank1.pt" in written["digests_rank1.json"]
    assert report["proven"] is None and report["after_repair"] is None
    lines, damaged = report["checked"]  # `megatron-ppo verify-checkpoint <the run's directory>`
    shard = report["resumed"]["a shard"][0]
    assert damaged == 1 and len(lines) == 3, lines
    assert "step_2: proves its bytes (" in lines[0] and "step_4: proves its bytes (" in lines[1], lines
    assert "step_6: damaged: 1 of its" in lines[2] and lines[2].endswith(shard), lines
    assert len(report["resumed"]) == 6
    for kind, (name, source, messages, same_size, refusal) in report["resumed"].items():
        assert same_size, kind
        assert source == "step_4", (kind, messages)
        assert "skipped step_6, which latest named: 1 of its" in messages, (kind, messages)
        assert f"): {name}" in messages, (kind, messages)  # the file named
        assert f"checkpoint {tmp_path / 'ckpt'}/step_6 is damaged: 1 of its" in refusal and name in refusal, refusal


def test_a_checkpoints_bytes_are_read_by_every_rank_a_share_each(tmp_path) -> None:
    """Rank 0 decides, but each file is hashed by one rank of the job, the bytes shared out (9000 + 3000 + 1000 and
    7000 + 5000 + 800 bytes here): at 16 nodes a 235B checkpoint is read at the nodes' bandwidth, not rank 0's
    alone; the file overwritten in place is named whichever rank read it."""
    ranks = run_distributed(checkpoint_workers.proven_together, 2, str(tmp_path))
    assert ranks[0]["hashed"] == ["__0_0.distcp", "__3_0.distcp", "__4_0.distcp"], ranks
    assert ranks[1]["hashed"] == ["__1_0.distcp", "__2_0.distcp", "__5_0.distcp"], ranks
    assert "1 of its 6 files hold other bytes than when saved" in ranks[0]["message"], ranks[0]["message"]
    assert ranks[0]["message"].endswith("__3_0.distcp") and ranks[0]["clean"] is None
