#!/usr/bin/env bash
# Wheels for a CUDA machine that has Python 3.12 and PyTorch but no network and none of this project's other needs
# (the GPU hosts this project is checked on lack megatron-core, omegaconf and antlr4-python3-runtime): fetched here,
# at the versions of requirements/lock.txt, for CPython 3.12 on x86-64 Linux, without their dependencies.
# Usage: make gpu-wheels [WHEELS=.whl]   then carry .whl/ to the GPU machine and run `make gpu-check` there.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.whl}
lock=requirements/lock.txt
mkdir -p "$out"
pinned() { grep -i "^$1==" "$lock" || { echo "$1 is not in $lock" >&2; exit 1; }; }
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
for name in megatron-core omegaconf; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$out" "$(pinned "$name")"
done
# antlr4-python3-runtime (omegaconf's parser) is published as an sdist only: build its pure-Python wheel here.
python3 -m pip wheel -q --no-deps -w "$out" "$(pinned antlr4-python3-runtime)"
ls -l "$out"/*.whl
