#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has torch, numpy, pyyaml, matplotlib, psutil, pytest; no
# megatron-core), into .whl/ (kept out of git by .git/info/exclude); carry .whl with the check.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
MCORE=$(python3 -c "from importlib.metadata import version; print(version('megatron-core'))" 2>/dev/null || echo 0.19.2)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "megatron-core==${MCORE%%+*}"
ls -la .whl
