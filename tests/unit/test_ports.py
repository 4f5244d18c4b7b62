"""The tests' rendezvous-port helper: a launch whose port was taken before it bound it is tried again on another
port; any other failure is not."""

from __future__ import annotations

import pytest

from bench.ports import on_a_free_port

TAKEN = "The server socket has failed to listen on any local network address. port: 1, code: -98, name: EADDRINUSE"


def test_a_taken_port_is_tried_again_on_another_and_other_failures_are_not() -> None:
    ports: list[int] = []

    def taken_once(port: int) -> str:
        ports.append(port)
        if len(ports) == 1:
            raise AssertionError(f"rank 0 failed:\n{TAKEN}")
        return "trained"

    assert on_a_free_port(taken_once) == "trained" and len(ports) == 2

    logs = iter([TAKEN, TAKEN, "done"])  # a launch that reports through its log (a subprocess, a Slurm job)
    assert on_a_free_port(lambda port: next(logs), log=lambda text: text) == "done"

    def broken(port: int) -> str:
        raise AssertionError("rank 1 failed: a real error")

    with pytest.raises(AssertionError, match="a real error"):
        on_a_free_port(broken)
    always = iter([TAKEN] * 5)
    assert on_a_free_port(lambda port: next(always), log=lambda text: text, attempts=3) == TAKEN  # gives up
