#!/usr/bin/env bash
# Wheels for a CUDA machine that has Python 3.12 and PyTorch but no network and none of this project's other needs:
# every distribution the package and the check import when they load, and what those require, less what PyTorch
# requires (the list is derived by `python -m gpu_check.wheels` from the code's imports and this environment's
# metadata), at the versions of requirements/lock.txt, for CPython 3.12 on x86-64 Linux, without dependencies.
# Usage: make gpu-wheels [WHEELS=.whl]   then carry .whl/ to the GPU machine and run `make gpu-check` there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
target=${2:-}  # the target machine's `pip list --format=freeze`: fetch only what it lacks
py=${PY:-python3}
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for pin in $("$py" -m gpu_check.wheels ${target:+--target "$target"}); do
  if ! "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$out" "$pin" 2>/dev/null; then
    # published as an sdist only (antlr4-python3-runtime, omegaconf's parser): build its wheel here
    "$py" -m pip wheel -q --no-deps -w "$out" "$pin"
  fi
done
ls -l "$out"/*.whl
