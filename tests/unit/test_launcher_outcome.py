"""Which outcome `train --nproc` reports at the shell (`launcher.conclude`), and how a worker hands it over
(`launcher.tell_user`). The real launches are tests/e2e/test_launcher.py; these are the choices between ranks that a
launch cannot stage on demand (which rank fails first, a death in the same second as another rank's error)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from megatron_ppo.launcher import FIRST_FAILURES_S, OUTCOME_DIR, Exit, Outcome, conclude, read_outcomes, tell_user
from megatron_ppo.train.preemption import MARKER_ENV

BUG = Outcome(0, 1, "Traceback ... Connection reset by peer\nthis is a bug in megatron-ppo")
CONFIG = Outcome(1, 2, "error: 1 config problem")
KILL, TERM = -signal.SIGKILL, -signal.SIGTERM


def test_a_rank_killed_by_another_signal_is_reported_before_the_errors_that_follow_from_it() -> None:
    """Rank 1 SIGKILLed; rank 0's collective then fails (its "bug" outcome) in the same second."""
    outcome = conclude({0: BUG}, {1: Exit(KILL, 100), 0: Exit(1, 100)}, None, "python -m megatron_ppo train r.yaml")
    assert outcome.status == 128 + signal.SIGKILL and outcome.rank == -1
    assert outcome.text.startswith("error: rank 1 died (SIGKILL)") and "resume with: python -m" in outcome.text


def test_the_agents_own_signals_are_not_deaths() -> None:
    """Rank 1 decides a config error; the agent SIGTERMs rank 0, which is SIGKILLed 30 s later (stuck in a
    collective): rank 1's outcome, whichever rank it is."""
    exits = {1: Exit(2, 100), 0: Exit(KILL, 100 + 30)}
    assert conclude({1: CONFIG}, exits, None, "") == CONFIG
    assert conclude({1: CONFIG}, {1: Exit(2, 100), 0: Exit(TERM, 100)}, None, "") == CONFIG
    late = {1: Exit(2, 100), 0: Exit(KILL, 100 + FIRST_FAILURES_S + 1)}
    assert conclude({1: CONFIG}, late, None, "") == CONFIG


def test_the_lowest_rank_with_a_non_zero_status_speaks_else_rank_0() -> None:
    interrupted = {r: Outcome(r, 130, "interrupted: saved step_4; resume with: ...") for r in (0, 1)}
    assert conclude(interrupted, {0: Exit(130, 5), 1: Exit(130, 5)}, signal.SIGINT, "").rank == 0
    assert conclude({0: Outcome(0, 0, "stopped early"), 1: CONFIG}, {1: Exit(2, 5)}, None, "") == CONFIG
    budget = {r: Outcome(r, 0, "stopped early: saved step_4; exiting with 0") for r in (0, 1)}
    assert conclude(budget, {}, None, "") == budget[0]


def test_a_worker_stopped_by_the_agents_sigterm_never_speaks_before_the_error_that_caused_it() -> None:
    """Rank 1 finds a config error and exits 2; the agent SIGTERMs rank 0, still in its set-up, which says it was
    stopped (75): the launcher, which received no signal, reports rank 1's error. With a signal to the launcher (a
    real preemption) the lowest rank's outcome stands."""
    stopped = Outcome(0, 75, "stopped early by SIGTERM before training: nothing new to save; exiting with 75")
    exits = {0: Exit(75, 6), 1: Exit(2, 5)}
    assert conclude({0: stopped, 1: CONFIG}, exits, None, "") == CONFIG
    assert conclude({0: stopped, 1: CONFIG}, exits, signal.SIGTERM, "") == stopped


def test_without_an_outcome_the_status_or_the_signal_is_said() -> None:
    crashed = conclude({}, {1: Exit(1, 5), 0: Exit(TERM, 5)}, None, "")
    assert crashed.status == 1 and "rank 1 exited with status 1" in crashed.text
    # a preemption signal before any worker said anything: the workers were starting, nothing to save — requeued
    stopped = conclude({}, {}, signal.SIGTERM, "")
    assert (
        stopped.status == 75 and "stopped early by SIGTERM before training (its workers were starting)" in stopped.text
    )
    # the same signal after the workers said their run ended as planned: no preemption, nothing requeued
    done = conclude({0: Outcome(0, 0, ""), 1: Outcome(1, 0, "")}, {}, signal.SIGTERM, "")
    assert (done.status, done.text) == (0, "")
    hung_up = conclude({}, {}, signal.SIGHUP, "")
    assert hung_up.status == 128 + signal.SIGHUP and "SIGHUP" in hung_up.text
    assert conclude({}, {}, None, "") == Outcome(-1, 0, "")


def test_a_worker_under_the_launcher_writes_its_outcome_and_prints_nothing(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv(OUTCOME_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert tell_user(2, "error: x") == 2
    assert capsys.readouterr().err == ""
    assert json.loads((tmp_path / "rank1.json").read_text()) == {"status": 2, "text": "error: x"}
    assert read_outcomes(tmp_path) == {1: Outcome(1, 2, "error: x")}
    monkeypatch.delenv(OUTCOME_DIR)
    assert tell_user(2, "error: y") == 2 and capsys.readouterr().err == "", "rank 1 of torchrun: rank 0 says it"
    assert tell_user(1, "a traceback", every_rank=True) == 1 and capsys.readouterr().err == "a traceback\n"


def test_a_stop_before_training_that_cannot_unwind_ends_at_once_with_75_and_says_so(tmp_path) -> None:
    """The unwinding of a stop signal before training can wait in a collective another process never joins (the
    task's process groups made again, a barrier): after `SET_UP_STOP_GRACE_S` the process says it was stopped and
    ends with 75 instead of waiting for the agent's SIGKILL, which leaves neither outcome nor marker."""
    stuck = ("from megatron_ppo.train.preemption import end_within; import time\n"
             "from megatron_ppo.launcher import tell_user\n"
             "end_within(0.5, 'SIGTERM', tell_user)\ntime.sleep(60)  # a collective no one joins\n")  # fmt: skip
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-c", stuck], env={**os.environ, OUTCOME_DIR: str(tmp_path)}, timeout=30)
    assert ended.returncode == 75 and time.monotonic() - started < 20
    (outcome,) = read_outcomes(tmp_path).values()
    assert outcome.status == 75 and "did not end within 0.5 s of the signal" in outcome.text, outcome.text


def test_under_plain_torchrun_a_stuck_stop_before_training_is_the_launchers_not_a_preemption(tmp_path) -> None:
    """Started by plain `torchrun` (no `train --nproc`, no Slurm marker), blocked in C++ when torchrun SIGTERMs it
    because a peer failed: after the grace it says it was stopped by the launcher (another rank failed first?) and
    ends 143, no marker — the watch's own thread used to say "requeued" and end 75."""
    blocked = (
        "import datetime\nfrom torch.distributed import TCPStore\n"
        "from megatron_ppo.train.preemption import watching\n"
        "store = TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=60))\n"
        "import time\ntry:\n    with watching():\n        print('waiting', flush=True)\n"
        "        store.wait(['never'], datetime.timedelta(seconds=60))\n"
        "except BaseException:\n    time.sleep(30)\n"
    )  # on a loaded machine the signal may come before the wait: the process is then stuck in the sleep
    env = {key: value for key, value in os.environ.items() if key not in (OUTCOME_DIR, MARKER_ENV)}
    env |= {"TORCHELASTIC_RUN_ID": "plain", "RANK": "0", "WORLD_SIZE": "1"}
    process = subprocess.Popen([sys.executable, "-c", blocked], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout.readline() == "waiting\n"
    time.sleep(0.5)  # in the store's wait
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=40) == 128 + signal.SIGTERM
    said = process.stderr.read()
    assert "stopped by SIGTERM from the launcher before training (another rank failed first?" in said, said
    assert "requeued" not in said and not list(tmp_path.iterdir()), said


def test_a_signal_before_training_is_heard_while_the_main_thread_is_blocked_in_cpp(tmp_path) -> None:
    """The signal comes while the main thread waits in C++ for a peer the same signal stopped (here a TCP store's
    wait for a key no one sets): the Python handler cannot run until that returns, so the watch's own thread hears
    the signal (`set_wakeup_fd`), writes the marker and ends the process `SET_UP_STOP_GRACE_S` later with 75 and its
    line. Before, nothing ran until the agent's SIGKILL 30 s later: no line, no marker (`make faults`, "SIGTERM
    during set-up ×20": one run in 20)."""
    marker = tmp_path / "preempted"
    blocked = ("import datetime, sys\nfrom torch.distributed import TCPStore\n"
               "from megatron_ppo.launcher import tell_user\nfrom megatron_ppo.train.preemption import watching\n"
               "store = TCPStore('127.0.0.1', 0, 1, True, timeout=datetime.timedelta(seconds=60))\n"
               "with watching(say=tell_user):\n    print('waiting', flush=True)\n"
               "    store.wait(['never'], datetime.timedelta(seconds=60))\n")  # fmt: skip
    env = {**os.environ, OUTCOME_DIR: str(tmp_path), MARKER_ENV: str(marker), "RANK": "0", "WORLD_SIZE": "1"}
    process = subprocess.Popen([sys.executable, "-c", blocked], env=env, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "waiting\n"
    time.sleep(0.5)  # in the store's wait
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=40) == 75
    assert time.monotonic() - signalled < 15, "ended after the grace, not at the store's timeout"
    (outcome,) = read_outcomes(tmp_path).values()
    assert outcome.status == 75 and "did not end within 3 s of the signal" in outcome.text, outcome.text
    assert marker.exists(), "the batch script requeues on it"
