"""The faults a user can cause, each run through the real command line on the tiny recipe, with what the user saw,
the exit status and what was kept (`make faults` prints them as a table; `tests/e2e/test_faults.py` asserts them).

Every case starts from a copy of one finished run (`base_run`: 6 steps, a checkpoint every 2, one process) and
damages or misuses it as a user would. "Kept" is checked, not assumed: `latest`, the checkpoints' files and
anything written outside the run's directories are compared before and after.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.tiny import RECIPE, REPO
from megatron_ppo.checkpoint.directory import named_by_latest
from megatron_ppo.cli import BUG, LIBRARY_NOTICES
from megatron_ppo.train.preemption import MARKER_ENV, PREEMPTED_EXIT

# One process, a quick SFT start: what is tested is what a fault does to the run's files, not how well it learns
QUICK = [
    "data.addition.num_prompts=64", "data.addition.num_heldout=16", "data.addition.samples_per_prompt=2",
    "data.addition.sft_steps=20", "data.addition.sft_batch_size=32", "data.train_batch_size=32",
    *(f"{role}.{key}=16" for role in ("actor", "critic")
      for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu")),
    *(f"{role}.megatron.tensor_model_parallel_size=1" for role in ("actor", "ref", "critic")),
    "cluster.gpus_per_node=1", "trainer.test_freq=0", "trainer.save_freq=2", "trainer.max_ckpt_to_keep=3",
    "trainer.total_training_steps=6", "trainer.val_before_train=false",
]  # fmt: skip


@dataclass
class Outcome:
    exit_code: int
    saw: str  # the line the user saw about the fault
    kept: str  # what was kept, as checked
    ok: bool  # the exit status, the message and the files are as the case expects
    log: str = ""


@dataclass(frozen=True)
class Case:
    name: str
    fault: str
    run: Callable[[Path, Path], Outcome]  # (a fresh folder holding a copy of the base run, the task cache)
    in_tests: bool = field(default=True)  # also run by tests/e2e/test_faults.py (the others: `make faults` only)


def cli(folder: Path, work: Path, args: list[str], env: dict[str, str] | None = None,
        wrap: list[str] | None = None) -> tuple[int, str]:  # fmt: skip
    """`python -m megatron_ppo ARGS` in one process (the run's directories under `folder`); (exit status, output)."""
    # no MASTER_PORT: a single process binds a port the OS picks (`launch_env.ANY_FREE_PORT`)
    inherited = {name: value for name, value in os.environ.items() if name != "MASTER_PORT"}
    environment = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "1000",
                   "PYTHONPATH": str(REPO), **(env or {})}  # fmt: skip
    command = [sys.executable, "-m", "megatron_ppo", *args]
    if args[0] == "train":
        command = [*command[:4], str(RECIPE), *QUICK, f"data.addition.work_dir={work}",
                   f"trainer.default_local_dir={folder}/ckpt", f"trainer.log_dir={folder}/tb", *args[1:]]  # fmt: skip
    result = subprocess.run([*(wrap or []), *command], cwd=REPO, env=environment, capture_output=True, text=True,
                            timeout=900, check=False)  # fmt: skip
    return result.returncode, result.stdout + result.stderr


def error_line(output: str) -> str:
    """The `error:` line, with the first problem of a config error's list ('' when there is none)."""
    lines = output.splitlines()
    index = next((i for i, line in enumerate(lines) if line.startswith("error:")), None)
    if index is None:
        return ""
    shown = lines[index]
    if shown.endswith(":") and index + 1 < len(lines):
        shown += " " + lines[index + 1].strip().removeprefix("- ")
    return shown


def line_with(output: str, text: str) -> str:
    return next((line.strip() for line in output.splitlines() if text in line), "")


def snapshot(root: Path) -> dict[str, int | str]:
    """Every file under `root` with its size (`latest`, `run.json`: their text), for before/after comparisons."""
    found: dict[str, int | str] = {}
    for path in sorted(root.rglob("*")) if root.is_dir() else []:
        if path.is_file() and path.name != ".lock":
            name = str(path.relative_to(root))
            found[name] = path.read_text() if path.name == "latest" else path.stat().st_size
    return found


def _refused(code: int, output: str, expected: str, before: dict, after: dict, extra_ok: bool = True) -> Outcome:
    saw = error_line(output)
    unchanged = before == after
    kept = ("everything: latest and every checkpoint file unchanged" if unchanged else
            f"CHANGED: {sorted(set(before.items()) ^ set(after.items()))[:4]}")  # fmt: skip
    quiet = not any(notice in output for notice in LIBRARY_NOTICES)  # Megatron's import-time notices: debug log only
    ok = code == 2 and expected in output and unchanged and "Traceback" not in output and quiet and extra_ok
    return Outcome(code, saw, kept, ok, output)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _shard(checkpoint: Path) -> Path:
    return sorted(checkpoint.glob("*.distcp"))[0]


# --- the cases ----------------------------------------------------------------------------------------------------


def convert_into_run(folder: Path, work: Path) -> Outcome:
    ckpt = folder / "ckpt"
    before = snapshot(ckpt)
    code, output = cli(folder, work, ["convert", "hf-to-mcore", "--hf", str(folder / "hf"), "--out", str(ckpt)])
    return _refused(code, output, "holds a training run's checkpoints", before, snapshot(ckpt))


def resume_path_to_damaged(folder: Path, work: Path) -> Outcome:
    ckpt = folder / "ckpt"
    _truncate(_shard(ckpt / "step_2"))
    before = snapshot(ckpt)
    code, output = cli(folder, work, ["train", "trainer.resume_mode=resume_path",
                                      f"trainer.resume_from_path={ckpt}/step_2"])  # fmt: skip
    return _refused(code, output, f"checkpoint {ckpt}/step_2 is damaged", before, snapshot(ckpt))


def auto_past_damaged_latest(folder: Path, work: Path) -> Outcome:
    """`latest` names a truncated step_6 and a killed job left its lock: the run takes the lock over, resumes from
    step_4, says what it skipped and why, and trains steps 5 and 6 again."""
    ckpt = folder / "ckpt"
    _truncate(_shard(ckpt / "step_6"))
    (ckpt / ".lock").write_text(json.dumps({"host": "node7", "pid": 4242, "job_id": "917", "started": "earlier"}))
    code, output = cli(folder, work, ["train"])
    skipped = line_with(output, "skipped step_6")
    took_over = line_with(output, "took over the lock")
    named = (ckpt / "latest").read_text()
    ok = code == 0 and "resumed from" in skipped and "differ from manifest.json" in skipped and took_over != ""
    ok = ok and named == "step_6" and "step 5:" in output
    kept = f"step_2, step_4; step_6 saved again over the damaged one, latest → {named}"
    saw = skipped[skipped.index("resumed") :].rsplit(" continues", 1)[0] + " continues" if skipped else ""
    return Outcome(code, saw, kept, ok, output)


def auto_past_overwritten_latest(folder: Path, work: Path) -> Outcome:
    """64 KiB in the middle of a shard of step_6, which `latest` names, overwritten with zeros at the shard's size
    (`dd conv=notrunc`: bit rot, another job's write): the run names the shard, resumes from step_4 and trains steps
    5 and 6 again; the damaged step_6 is saved again over."""
    ckpt = folder / "ckpt"
    shard = _overwrite_in_place(ckpt / "step_6")
    code, output = cli(folder, work, ["train"])
    skipped = line_with(output, "skipped step_6")
    named = (ckpt / "latest").read_text()
    ok = code == 0 and "resumed from" in skipped and "hold other bytes than when saved" in output
    ok = ok and shard.name in output and named == "step_6" and "step 5:" in output
    kept = f"step_2, step_4; step_6 saved again over the damaged one, latest → {named}"
    saw = line_with(output, "hold other bytes")
    return Outcome(code, saw[saw.index("1 of its") :] if "1 of its" in saw else saw, kept, ok, output)


def _overwrite_in_place(checkpoint: Path) -> Path:
    """64 KiB in the middle of one of `checkpoint`'s shards overwritten with zeros, its size kept; returns it."""
    shard = sorted(checkpoint.glob("*.distcp"))[-1]
    with shard.open("r+b") as file:
        file.seek(shard.stat().st_size // 2)
        file.write(bytes(65536))
    return shard


def rollback_after_a_fallback_resume(folder: Path, work: Path) -> Outcome:
    """step_6 overwritten in place, the run resumed from step_4 under a KL limit every update passes: the rollback
    at step 5 returns to step_4 — judged good by step 5's guards in the run that saved it, after its save (whose
    trainer state names step_2) — and the second rollback asked for stops the run (exit 3) with step_4 left."""
    ckpt = folder / "ckpt"
    _overwrite_in_place(ckpt / "step_6")
    code, output = cli(folder, work, ["train", "guards.kl_explosion_threshold=1e-9", "guards.max_rollbacks=1"])
    rolled = line_with(output, "rolled back to")
    ok = code == 3 and f"rolled back to {ckpt / 'step_4'}," in rolled and "resumed from" in output
    named = (ckpt / "latest").read_text()
    return Outcome(code, rolled[rolled.index("rolled back") :] if rolled else "", f"latest → {named}", ok, output)


def changed_run_length(folder: Path, work: Path) -> Outcome:
    ckpt = folder / "ckpt"
    before = snapshot(ckpt)
    code, output = cli(folder, work, ["train", "trainer.total_training_steps=8"])
    return _refused(code, output, "trainer.total_training_steps", before, snapshot(ckpt))


SET_UP_POINTS, SET_UP_SPAN_S, SET_UP_STOP_LIMIT_S = 20, 14.0, 5.0


def _stopped_at(folder: Path, delay_s: float) -> tuple[int, float, bool, str]:
    """`train --nproc 2` from scratch (its own task cache: tokenizer, data, SFT) under the batch script's marker,
    SIGTERM to the launcher `delay_s` after it starts: (exit status, seconds from the signal to the exit, whether the
    marker was written, output)."""
    marker = folder / "preempted"
    inherited = {name: value for name, value in os.environ.items() if name != "MASTER_PORT"}
    environment = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "COLUMNS": "1000",
                   "PYTHONPATH": str(REPO), MARKER_ENV: str(marker)}  # fmt: skip
    command = [sys.executable, "-m", "megatron_ppo", "train", "--nproc", "2", str(RECIPE), *QUICK,
               "cluster.gpus_per_node=2", "trainer.total_training_steps=60",  # still training at the last moment
               *(f"{role}.ppo_micro_batch_size_per_gpu=8" for role in ("actor", "critic")),
               f"data.addition.work_dir={folder}/work", f"trainer.default_local_dir={folder}/ckpt",
               f"trainer.log_dir={folder}/tb"]  # fmt: skip
    with open(folder / "output.txt", "w+") as log:
        process = subprocess.Popen(command, cwd=REPO, env=environment, stdout=log, stderr=subprocess.STDOUT)
        time.sleep(delay_s)
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
        took = time.monotonic() - signalled
        log.seek(0)
        return code, took, marker.exists(), log.read()


def signals_during_set_up(folder: Path, work: Path) -> Outcome:
    """SIGTERM (Slurm's preemption) to `train --nproc 2` at `SET_UP_POINTS` moments spread over a first start's
    set-up (workers starting, the tokenizer, the data, the task's SFT, the models) and its first steps: every run ends
    75 with the batch script's marker within `SET_UP_STOP_LIMIT_S` of the signal."""
    results = []
    for point in range(SET_UP_POINTS):
        delay = 0.5 + point * SET_UP_SPAN_S / (SET_UP_POINTS - 1)
        (folder / f"point-{point}").mkdir()
        code, took, marked, output = _stopped_at(folder / f"point-{point}", delay)
        results.append((delay, code, took, marked, output))
    good = [r for r in results if r[1] == PREEMPTED_EXIT and r[3] and r[2] <= SET_UP_STOP_LIMIT_S]
    worst = max(r[2] for r in results)
    bad = [f"{d:.1f} s: exit {c}, {t:.1f} s, marker {m}" for d, c, t, m, _ in results if (d, c, t, m, _) not in good]
    saw = (f"{len(good)} of {len(results)} ended 75 with the marker within {SET_UP_STOP_LIMIT_S:g} s (slowest "
           f"{worst:.1f} s)")  # fmt: skip
    log = "\n".join(f"--- {r[0]:.1f} s\n{r[4][-1500:]}" for r in results if r not in good)
    return Outcome(
        0 if not bad else 1, saw + (f"; not: {'; '.join(bad)}" if bad else ""), "nothing new to save", not bad, log
    )


def second_job(folder: Path, work: Path) -> Outcome:
    ckpt = folder / "ckpt"
    before = snapshot(ckpt)
    with _lock_held_elsewhere(ckpt) as holder:
        code, output = cli(folder, work, ["train"])
    return _refused(code, output, f"in use by another job (pid {holder}", before, snapshot(ckpt))


@contextlib.contextmanager
def _lock_held_elsewhere(ckpt: Path) -> Iterator[int]:
    """Another process holding the run directory's lock, as a running job does; yields its pid."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from megatron_ppo.checkpoint import lock; "
                               "lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(900)", str(ckpt)],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": "5150"},
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.pid
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def run_id_is_a_path(folder: Path, work: Path) -> Outcome:
    ckpt = folder / "ckpt"
    identity = json.loads((ckpt / "step_6" / "run.json").read_text())
    (ckpt / "step_6" / "run.json").write_text(json.dumps(identity | {"run_id": "../../escaped"}))
    before, outside = snapshot(ckpt), sorted(p.name for p in folder.parent.iterdir())
    code, output = cli(folder, work, ["train"])
    nothing_outside = sorted(p.name for p in folder.parent.iterdir()) == outside
    return _refused(code, output, "which is no run id", before, snapshot(ckpt), nothing_outside)


def unwritable_checkpoint_directory(folder: Path, work: Path) -> Outcome:
    """The run's checkpoint directory mounted read-only (a user namespace's bind mount): refused at the start, before
    any model is built, naming the key — not at the first save after the training."""
    ckpt = folder / "ckpt"
    before = snapshot(ckpt)
    code, output = cli(folder, work, ["train"], wrap=_mounted(f"mount --bind {ckpt} {ckpt} && "
                                                              f"mount -o remount,ro,bind {ckpt}"))  # fmt: skip
    return _refused(code, output, "trainer.default_local_dir=", before, snapshot(ckpt), "step 1:" not in output)


def disk_full_at_save(folder: Path, work: Path) -> Outcome:
    """A new run whose checkpoint directory is a 4 MiB disk (tmpfs; a checkpoint is ~10 MB): the first save fails,
    says the disk is full and removes its partial write."""
    space = folder / "small-disk"
    space.mkdir()
    code, output = cli(folder, work, ["train", "trainer.resume_mode=disable", f"trainer.default_local_dir={space}"],
                       wrap=_mounted(f"mount -t tmpfs -o size=4m tmpfs {space}", listing=space))  # fmt: skip
    saw, left = error_line(output), line_with(output, "left on the disk:")
    # the tmpfs is gone with the namespace: what was left on it is the listing the wrapper printed at exit
    ok = code == 2 and "the disk is full" in saw and "the partial save was removed" in saw and "Traceback" not in output
    ok = ok and left != "" and ".tmp_step" not in left
    ok = ok and "encountered an error" not in output and "error is caught" not in output  # the writer's own lines
    return Outcome(code, saw, f"no partial save ({left or 'no listing'}); the steps since the last save are lost", ok,
                   output)  # fmt: skip


def disk_full_with_the_logs(folder: Path, work: Path) -> Outcome:
    """The TensorBoard logs on a disk that fills up after the run has started (64 KiB left of 4 MiB): the logs'
    next write finds it full. One disk-full line naming trainer.log_dir, exit 2, the last checkpoint kept (before:
    TensorBoard's flush raised ENOSPC, its close raised it again: a traceback and "this is a bug")."""
    space, ckpt = folder / "small-disk", folder / "ckpt"
    space.mkdir()
    fill = f"head -c {4 * 2**20 - 64 * 2**10} /dev/zero > {space}/other-files"
    code, output = cli(folder, work, ["train", "trainer.resume_mode=disable", "trainer.overwrite=true",
                                      "trainer.total_training_steps=40", f"trainer.log_dir={space}/tb"],
                       wrap=_mounted(f"mount -t tmpfs -o size=4m tmpfs {space} && {fill}"))  # fmt: skip
    saw = error_line(output)
    latest = named_by_latest(ckpt)
    ok = code == 2 and "the disk is full" in saw and "trainer.log_dir" in saw and "Traceback" not in output
    ok = ok and BUG not in output and latest is not None and latest.is_dir()
    return Outcome(code, saw, f"latest names {latest.name if latest else 'nothing'}", ok, output)


def taken_port(folder: Path, work: Path) -> Outcome:
    import socket

    ckpt = folder / "ckpt"
    before = snapshot(ckpt)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, output = cli(folder, work, ["train"], env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    return _refused(code, output, f"port {port} on 127.0.0.1 (MASTER_PORT) is already in use", before, snapshot(ckpt))


def rollout_correction_without_log_probs(folder: Path, work: Path) -> Outcome:
    ckpt = folder / "ckpt"
    before = snapshot(ckpt)
    code, output = cli(folder, work, ["train", "algorithm.rollout_correction.rollout_is=token"])
    return _refused(code, output, "no 'behavior_log_probs'", before, snapshot(ckpt), "step 1:" not in output)


def zero_micro_batch(folder: Path, work: Path) -> Outcome:
    ckpt = folder / "ckpt"
    before = snapshot(ckpt)
    code, output = cli(folder, work, ["train", "actor.ppo_micro_batch_size_per_gpu=0"])
    return _refused(code, output, "actor.ppo_micro_batch_size_per_gpu=0: must be ≥ 1", before, snapshot(ckpt))


def plan_zero_nodes(folder: Path, work: Path) -> Outcome:
    code, output = cli(folder, work, ["plan", str(RECIPE), "--nodes", "0"])
    return _refused(code, output, "cluster.nodes=0: must be ≥ 1", {}, {})


def _mounted(setup: str, listing: Path | None = None) -> list[str]:
    """A command prefix running the command in a private mount namespace after `setup` (as an unprivileged user's
    namespace allows): the mounts exist for that command only; `listing`: print what that folder holds at the end."""
    then = (
        f'"$@"; status=$?; echo "left on the disk: $(ls -A {listing} | tr "\\n" " ")"; exit $status'
        if listing
        else 'exec "$@"'
    )
    return ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", f"{setup} && {{ {then}; }}", "sh"]


CASES = [
    Case("convert into a run", "convert hf-to-mcore --out <a run's checkpoint directory>", convert_into_run),
    Case(
        "resume_path damaged",
        "trainer.resume_from_path=<step_2, a shard truncated>; latest names step_6",
        resume_path_to_damaged,
    ),
    Case(
        "auto, latest damaged",
        "latest names step_6, a shard truncated; a killed job's lock left behind",
        auto_past_damaged_latest,
    ),
    Case(
        "auto, latest overwritten",
        "latest names step_6, 64 KiB of a shard overwritten with zeros at its size",
        auto_past_overwritten_latest,
    ),
    Case(
        "rollback after a fallback resume",
        "step_6 overwritten in place, resumed from step_4 with guards.kl_explosion_threshold=1e-9",
        rollback_after_a_fallback_resume,
    ),
    Case("second job", "train while another job holds the run directory", second_job),
    Case(
        "SIGTERM during set-up ×20",
        f"SIGTERM to train --nproc 2 at {SET_UP_POINTS} moments of a first start's set-up",
        signals_during_set_up,
        in_tests=False,
    ),
    Case("disk full", "the checkpoint directory's disk fills up during the first save", disk_full_at_save),
    Case("disk full, logs", "the checkpoints' and the logs' one disk fills up", disk_full_with_the_logs),
    Case("run id a path", "run.json of step_6 names the run '../../escaped'", run_id_is_a_path, in_tests=False),
    Case(
        "read-only directory",
        "the checkpoint directory cannot be written",
        unwritable_checkpoint_directory,
        in_tests=False,
    ),
    Case(
        "changed run length", "resume with trainer.total_training_steps=8 (was 6)", changed_run_length, in_tests=False
    ),
    Case("port taken", "one process while MASTER_PORT is in use", taken_port, in_tests=False),
    Case(
        "rollout_is, no log-probs",
        "algorithm.rollout_correction.rollout_is=token on rows without them",
        rollout_correction_without_log_probs,
        in_tests=False,
    ),
    Case("micro-batch 0", "actor.ppo_micro_batch_size_per_gpu=0", zero_micro_batch, in_tests=False),
    Case("plan --nodes 0", "plan recipes/tiny-cpu.yaml --nodes 0", plan_zero_nodes, in_tests=False),
]


def base_run(directory: Path) -> Path:
    """The run every case starts from: 6 steps, checkpoints at 2, 4 and 6 (`latest` names step_6); returns its
    folder (`ckpt/`, `tb/`, the task cache `work/`)."""
    code, output = cli(directory, directory / "work", ["train", "trainer.resume_mode=disable"])
    if code != 0:
        raise AssertionError(f"the base run exited {code}:\n{output[-3000:]}")
    return directory


def run_case(case: Case, base: Path, directory: Path) -> Outcome:
    """`case` on a fresh copy of the base run's checkpoints and logs (the task cache is shared, read only)."""
    folder = directory / case.name.replace(" ", "-").replace(",", "")
    folder.mkdir(parents=True)
    for part in ("ckpt", "tb"):
        shutil.copytree(base / part, folder / part)
    return case.run(folder, base / "work")
