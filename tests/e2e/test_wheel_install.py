"""`pip install .` (not editable) gives a working package: the wheel carries `configs/` as package data, so a recipe
validated from another directory resolves its `defaults:` from the installed copy, not from this source tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from bench.tiny import REPO


def test_the_installed_wheel_validates_a_recipe_from_another_directory(tmp_path: Path) -> None:
    wheels, site, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)], check=True,
                   capture_output=True)  # fmt: skip
    (wheel,) = wheels.glob("megatron_ppo-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True)
    assert (site / "megatron_ppo" / "configs" / "defaults.yaml").is_file(), "configs/ is missing from the wheel"
    assert not (site / "megatron_ppo" / "configs").is_symlink()
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("MEGATRON_PPO_CONFIG_DIR", None)
    show_config_dir = "import megatron_ppo.config.compose as c; print(c.CONFIG_DIR)"
    where = subprocess.run([sys.executable, "-c", show_config_dir], cwd=elsewhere, env=env, capture_output=True,
                           text=True, check=True).stdout.strip()  # fmt: skip
    assert Path(where).resolve() == (site / "megatron_ppo" / "configs").resolve(), where
    recipe = REPO / "recipes" / "qwen2.5-7b.yaml"
    result = subprocess.run([sys.executable, "-m", "megatron_ppo", "validate", str(recipe)], cwd=elsewhere, env=env,
                            capture_output=True, text=True, check=False)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "tensor_model_parallel_size" in result.stdout
