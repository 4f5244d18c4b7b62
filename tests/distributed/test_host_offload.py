"""Host offload between phases through the real trainer (one CPU process; a move to host keeps a second CPU copy
and empties the device storage, so the bookkeeping is real): where every role's params, grads and optimizer
states are in each phase, against the planner's rule and byte count; an offloaded run equals one without offload,
bit for bit; a run with offload stops, resumes from its checkpoint and matches the uninterrupted run."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

from tests.distributed import offload_workers
from tests.distributed.harness import run_distributed


@pytest.fixture(scope="module")
def without_offload():
    with tempfile.TemporaryDirectory() as root:
        yield run_distributed(offload_workers.run_to_the_end, 1, root, False)[0]


def test_each_phase_keeps_exactly_what_the_planner_counts_and_returns_it_intact(tmp_path: Path) -> None:
    report = run_distributed(offload_workers.placement_by_phase, 1, str(tmp_path))[0]
    for phase, seen in report["phases"].items():
        for role, measured in seen["measured"].items():
            counted = seen["counted"][role]
            assert (counted["params"], counted["grads"]) == (measured["params"], measured["grads"]), (
                f"{phase}/{role}: HostOffload counts {counted}, the tensors hold {measured}"
            )
            # the optimizer count adds Adam's step counters to the moments the tensors are read from here
            assert counted["optimizer"] >= measured["optimizer"] and (counted["optimizer"] > 0) == (
                measured["optimizer"] > 0
            ), f"{phase}/{role}: HostOffload counts {counted}, the tensors hold {measured}"
            for kind in report["kinds"]:
                has_kind = report["planned_bytes"][role][kind] > 0
                planned = has_kind and kind in seen["planned_kinds"][role]
                assert (measured[kind] > 0) == planned, (
                    f"{phase}: {role} {kind} {'on' if measured[kind] else 'off'} the device, the planner says "
                    f"{'on' if planned else 'off'}"
                )
                if planned:  # the planner's bytes (parameter count × bytes per kind) are the tensors' within 2 %
                    assert measured[kind] == pytest.approx(report["planned_bytes"][role][kind], rel=0.02)
    assert report["moments"] > 0, "the iteration must have created Adam moments to offload"
    assert report["changed"] == [], f"offloaded and restored, these differ: {report['changed']}"
    assert report["grads_zero_after_return"], "gradients come back zeroed, ready for the next accumulation"
    assert len(report["lines"]) == 4 + 5 + 1  # the iteration's four phases, the five entered here, the return
    assert report["lines"][0].startswith("experience: actor params")


def test_an_offloaded_run_equals_one_without_offload(without_offload, tmp_path: Path) -> None:
    offloaded = run_distributed(offload_workers.run_to_the_end, 1, str(tmp_path), True)[0]
    assert offloaded["history"] == without_offload["history"], "metrics differ with offload on"
    for role, tensors in without_offload["weights"].items():
        differ = [name for name, value in tensors.items() if value != offloaded["weights"][role][name]]
        assert not differ, f"{role} weights differ with offload on: {differ}"


def _far_apart(a: list[float], b: list[float], tol: float = 1e-6) -> bool:
    return len(a) != len(b) or any(not math.isclose(x, y, rel_tol=tol, abs_tol=tol) for x, y in zip(a, b, strict=True))


def test_a_run_with_offload_resumes_from_its_checkpoint(without_offload, tmp_path: Path) -> None:
    """Two jobs of a chain (stop after step 1 with a checkpoint; resume, step 2) equal the uninterrupted run
    within 1e-6, the end-to-end resume test's tolerance."""
    first = run_distributed(offload_workers.one_job_of_a_chain, 1, str(tmp_path))[0]
    assert first["resumed_from"] == "None" and first["history"] == without_offload["history"][:1]
    resumed = run_distributed(offload_workers.one_job_of_a_chain, 1, str(tmp_path))[0]
    assert resumed["resumed_from"].endswith("step_1"), resumed["resumed_from"]
    (step_2,), (expected,) = resumed["history"], without_offload["history"][1:]
    assert step_2.keys() == expected.keys()
    differ = {key: (step_2[key], value) for key, value in expected.items() if _far_apart([step_2[key]], [value])}
    assert not differ, f"the resumed step 2 differs from the uninterrupted run (resumed, uninterrupted): {differ}"
    for role, tensors in without_offload["weights"].items():
        differ = [name for name, value in tensors.items()
                  if _far_apart(torch.tensor(value).flatten().tolist(),
                                torch.tensor(resumed["weights"][role][name]).flatten().tolist())]  # fmt: skip
        assert not differ, f"{role} weights differ after the offloaded resume: {differ}"
