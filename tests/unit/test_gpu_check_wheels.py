"""`make gpu-wheels` fetches what a bare Python + PyTorch machine lacks: the list (`gpu_check.wheels`) derived from the
code's imports covers every module that loading the GPU check actually loads, and `--check` names a missing one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpu_check import wheels as gpu_wheels

REPO = Path(__file__).resolve().parents[2]
# A bare machine in this environment: the path finder made blind to every top-level module whose distribution is not
# allowed (argv[1]: the wheel list and what torch requires), as a machine without it would be; then what `make
# gpu-check` loads — the check (every part) and the trainer with the tiny task (parts (a), (h)). Optional imports
# (in a `try`) fail here as they would there.
BARE = """
import importlib.machinery, json, re, sys
from importlib import metadata

allowed = set(json.loads(sys.argv[1]))
providers = metadata.packages_distributions()


class Bare:
    # the path finder, blind to the modules of distributions a bare machine lacks (absent, not broken)

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        dists = providers.get(name) if "." not in name and name not in ("megatron_ppo", "bench", "gpu_check") else None
        if dists and not any(re.sub(r"[-_.]+", "-", d).lower() in allowed for d in dists):
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, name):
        return getattr(self.inner, name)


sys.meta_path[:] = [Bare(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
import gpu_check.parts, megatron_ppo.cli, megatron_ppo.train.run, megatron_ppo.tasks.addition
"""


def _bare_import(allowed: set[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BARE, json.dumps(sorted(allowed))], cwd=REPO, capture_output=True,
                          text=True, check=False)  # fmt: skip


def test_the_wheel_list_is_what_a_bare_python_and_pytorch_machine_lacks() -> None:
    wheels = {line.split("==")[0] for line in gpu_wheels.wheel_list()}
    present = gpu_wheels._requirement_closure({gpu_wheels.PRESENT})
    # the list of what the old script missed, and what it fetched; jinja2 comes with torch
    for name in ("megatron-core", "omegaconf", "antlr4-python3-runtime", "rich", "psutil", "pyarrow", "sentencepiece",
                 "tokenizers", "pyyaml", "tensorboard", "safetensors", "huggingface-hub"):  # fmt: skip
        assert name in wheels, (name, sorted(wheels))
    assert "jinja2" in present and not wheels & present, sorted(wheels & present)
    allowed = wheels | present | {"megatron-ppo"}
    result = _bare_import(allowed)
    assert result.returncode == 0, f"the check does not load with the wheels and torch only:\n{result.stderr[-3000:]}"
    without_yaml = _bare_import(allowed - {"pyyaml"})  # the finder does refuse: a missing wheel is seen
    assert without_yaml.returncode != 0 and "'yaml'" in without_yaml.stderr, without_yaml.stderr[-2000:]


def test_the_check_names_each_missing_module(tmp_path: Path) -> None:
    package = tmp_path / "megatron_ppo"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("import json\nimport yaml\nfrom megatron_ppo import b\n\n"
                                  "def later():\n    import wandb\n    from megatron_ppo.c import run\n")  # fmt: skip
    (package / "b.py").write_text("try:\n    import matplotlib\nexcept ImportError:\n    pass\n")
    (package / "c.py").write_text("from not_installed_anywhere.sub import x\n")
    (package / "unreached.py").write_text("import verl\n")
    names = gpu_wheels.load_time_imports(tmp_path, entries=("megatron_ppo.a",))
    # stdlib, own, function-level and `try` imports are not load-time; an own module a function imports is followed
    assert names == {"yaml", "not_installed_anywhere"}, names
    assert gpu_wheels.missing_modules(names) == ["not_installed_anywhere"]
    assert gpu_wheels.main(["--check"]) == 0, "this environment lacks a module the check loads"


def test_a_target_machine_gets_only_what_it_lacks_or_has_out_of_range(tmp_path: Path) -> None:
    """With the target's freeze: a distribution it has in the declared range is not fetched (nor what it requires);
    one it lacks is fetched with what that one requires and the target lacks; one out of range is fetched."""
    target = tmp_path / "freeze.txt"
    from importlib import metadata

    have = dict(line.split("==") for line in gpu_wheels.wheel_list())  # what a bare machine lacks, and torch's own
    have |= {name: metadata.version(name) for name in gpu_wheels._requirement_closure({gpu_wheels.PRESENT})}
    for name in ("megatron-core", "omegaconf", "antlr4-python3-runtime"):
        del have[name]
    target.write_text("".join(f"{name}=={version}\n" for name, version in have.items()))
    assert gpu_wheels.wheel_list(target=gpu_wheels.read_freeze(target)) == [
        "antlr4-python3-runtime==4.9.3", "megatron-core==0.19.2", "omegaconf==2.3.1"]  # fmt: skip
    have["pyarrow"] = "12.0.0"  # below the package's pyarrow>=15: fetched
    target.write_text("".join(f"{name}=={version}\n" for name, version in have.items()))
    fetched = {line.split("==")[0] for line in gpu_wheels.wheel_list(target=gpu_wheels.read_freeze(target))}
    assert "pyarrow" in fetched, fetched
