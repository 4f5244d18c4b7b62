"""What a user reads and types: the README's cluster quickstart runs as written against the shipped recipes, every
command's --help ends with an example, a Ctrl-C in training ends with a checkpoint and the command that resumes it,
and Megatron's import-time notices stay off the screen."""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from megatron_ppo import cli
from megatron_ppo.config import load_config
from megatron_ppo.launcher import NPROC
from megatron_ppo.train.preemption import INTERRUPTED_EXIT, Interrupted, Preempted, watching
from slurm import submit

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def _quickstart() -> list[str]:
    """The command lines of the README's "On your cluster" block."""
    section = README.split("## On your cluster", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def test_the_quickstart_walks_from_conversion_to_export() -> None:
    lines = _quickstart()
    steps = ["convert hf-to-mcore", "megatron-ppo validate", "megatron-ppo plan", "--dry-run", "slurm/submit.py",
             "tail -f logs/", "megatron-ppo report", "convert mcore-to-hf"]  # fmt: skip
    places = [next((i for i, line in enumerate(lines) if step in line), None) for step in steps]
    assert None not in places and places == sorted(places), list(zip(steps, places, strict=True))
    assert len(README.splitlines()) <= 200


@pytest.mark.parametrize("kind", ["megatron-ppo validate", "megatron-ppo plan", "--dry-run"])
def test_the_quickstart_line_runs_as_written(kind: str, capsys) -> None:
    (line,) = [line for line in _quickstart() if kind in line]
    words = shlex.split(line)
    cwd = Path.cwd()
    os.chdir(REPO)  # the lines name recipes/ relative to a checkout
    try:
        status = cli.main(words[1:]) if words[0] == "megatron-ppo" else submit.main(words[2:])
    finally:
        os.chdir(cwd)
    out = capsys.readouterr()
    assert status == 0, f"{line}\nexit {status}\n{out.out[-2000:]}{out.err[-2000:]}"
    if kind == "--dry-run":
        assert out.out.startswith("sbatch ") and "--nodes=4" in out.out, out.out


def test_the_readmes_links_lead_to_files() -> None:
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    missing = [t for t in targets if not t.startswith("http") and not (REPO / t).exists()]
    assert targets and not missing, missing


def _subcommands() -> dict[str, str]:
    parser = cli.build_parser()
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    return {name: command.format_help() for name, command in commands.choices.items()}


def test_every_commands_help_ends_with_one_example_command_line() -> None:
    helps = _subcommands()
    assert {"validate", "train", "score", "compare-kl", "plan", "report", "convert"} <= set(helps)
    for name, text in helps.items():
        last = text.rstrip().splitlines()[-2:]
        assert last[0] == "example:" and f" {name} " in f"{last[1]} ", f"{name} --help ends with {last}"
        assert re.match(r"  (megatron-ppo|torchrun .* -m megatron_ppo) ", last[1]), last[1]


def test_a_ctrl_c_before_the_loop_stops_at_once_and_in_it_after_the_iteration() -> None:
    before = signal.getsignal(signal.SIGINT)
    with watching() as watch:
        with pytest.raises(KeyboardInterrupt):  # nothing to save yet: stop now
            os.kill(os.getpid(), signal.SIGINT)
        with watch.in_the_loop():
            try:
                os.kill(os.getpid(), signal.SIGINT)  # remembered; the loop saves and stops at the iteration's end
            except KeyboardInterrupt:
                pytest.fail("a Ctrl-C in the training loop stopped it at once, without its checkpoint")
            assert watch.interrupted and watch.agreed()
            stop = watch.stop("ckpt/step_3")
            assert isinstance(stop, Interrupted) and stop.exit_status == INTERRUPTED_EXIT == 130
            with pytest.raises(KeyboardInterrupt):  # a second Ctrl-C: now
                os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before
    with watching() as watch:
        watch.signalled = signal.SIGTERM
        assert isinstance(watch.stop("ckpt/step_3"), Preempted)  # a preemption still requeues (exit 75)


def test_the_resume_command_repeats_the_launch_without_starting_another_run(monkeypatch) -> None:
    recipe = str(REPO / "recipes" / "tiny-cpu.yaml")
    overrides = ["trainer.resume_mode=disable", "trainer.overwrite=true", "actor.optim.lr=1e-5", "data.seed=3"]
    config = load_config(recipe, overrides)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.delenv("GROUP_WORLD_SIZE", raising=False)
    monkeypatch.delenv(NPROC, raising=False)
    python, torchrun = sys.executable, str(Path(sys.executable).with_name("torchrun"))  # not on this PATH
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    assert cli.resume_command(recipe, overrides, config) == (
        f"{torchrun} --standalone --nproc_per_node 2 -m megatron_ppo train {recipe} actor.optim.lr=1e-5 data.seed=3 "
        "trainer.resume_mode=auto"
    )  # the new run and the moving aside dropped, resuming asked for; one node: a rendezvous of its own
    monkeypatch.setenv(NPROC, "2")  # a worker of `train --nproc 2`
    assert cli.resume_command(recipe, ["x=a b"], None) == f"{python} -m megatron_ppo train --nproc=2 {recipe} 'x=a b'"
    monkeypatch.delenv(NPROC)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert cli.resume_command(recipe, ["x=a b"], None) == f"{python} -m megatron_ppo train {recipe} 'x=a b'"
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:/usr/bin:/bin")  # an activated environment
    assert cli.resume_command(recipe, [], None).startswith(f"{Path(sys.executable).name} -m megatron_ppo train ")


def test_the_resume_command_runs_as_printed(tmp_path) -> None:
    """From a shell whose PATH leads to another environment's `python` (or none): the printed command's program is
    the interpreter that ran the job, and its words are the CLI's (it began with a bare `python`)."""
    other = tmp_path / "other-env"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\nexit 1\n")
    (other / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{other}:/usr/bin:/bin"}
    code = ("import megatron_ppo.cli as c; print(c.resume_command('recipes/tiny-cpu.yaml', ['data.seed=3'], None, "
            "nproc=2))")  # fmt: skip
    printed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             cwd=REPO).stdout.strip()  # fmt: skip
    words = shlex.split(printed)
    program = shutil.which(words[0], path=env["PATH"])
    assert program is not None and os.path.samefile(program, sys.executable), printed
    ran = subprocess.run([*words[:3], "--help"], env=env, capture_output=True, text=True, cwd=REPO)
    assert ran.returncode == 0 and "train" in ran.stdout, ran.stderr[-2000:]
    assert cli.build_parser().parse_args(words[3:]).nproc == 2, printed


def test_megatrons_import_notices_go_to_the_debug_log_and_other_warnings_still_show(capsys, caplog) -> None:
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        cli.quiet_library_notices()
        with caplog.at_level(logging.DEBUG, logger="megatron_ppo.notices"):
            warnings.warn("Apex is not installed. Falling back to Torch Norm", UserWarning, stacklevel=1)
            logging.getLogger("torch.utils.cpp_extension").warning("No CUDA runtime is found, using CUDA_HOME='/x'")
            warnings.warn("a warning of another kind", UserWarning, stacklevel=1)
    assert [str(w.message) for w in shown] == ["a warning of another kind"]
    assert "CUDA runtime" not in capsys.readouterr().err
    logged = [r.getMessage() for r in caplog.records if r.name == "megatron_ppo.notices"]
    assert any("Apex is not installed" in m for m in logged) and any("No CUDA runtime" in m for m in logged), logged


@pytest.mark.parametrize("command", [["validate", "recipes/tiny-cpu.yaml"], ["plan", "recipes/qwen3-32b.yaml"]],
                         ids=lambda c: c[0])  # fmt: skip
def test_a_command_that_starts_no_process_group_does_not_import_megatron_core(command: list[str]) -> None:
    """validate and plan (as `slurm/ppo.sbatch` runs validate before every job, and a user on a login node) answer
    in ~3 s: megatron-core's ~5 s import comes only with the process-group functions, on first use."""
    probe = ("import sys; from megatron_ppo.cli import main; code = main(sys.argv[1:]); "
             "sys.exit(code or 3 * ('megatron.core' in sys.modules))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", probe, *command], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"exit {result.returncode} (3: megatron.core was imported)\n{result.stderr[-2000:]}"
