#!/usr/bin/env bash
# CI: megatron-oases as a user gets it. Builds the wheel, installs it into a fresh venv outside the
# source tree (its dependencies from the index; only torch and what torch needs are borrowed from
# the CI venv, read-only, to skip a multi-GB download), and from a directory outside the tree runs
# `oases compare --help`, an analytic profile and an ILP plan from the packaged cluster profile and
# model config, and a 2-rank `oases train` demo under --emulate-link. A checkout-only lookup (a file
# found beside the source tree, not in the wheel) fails here.
#
#   bash .ci/wheel_smoke.sh [PYTHON]     # PYTHON: the CI venv's interpreter (default: python)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-python}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/oases-wheel-smoke.XXXXXX")
[[ "${OASES_SMOKE_KEEP:-0}" == 1 ]] || trap 'rm -rf "${WORK}"' EXIT  # 1: keep it to look into
unset PYTHONPATH
START=$(date +%s)
say() { echo "wheel smoke [$(($(date +%s) - START)) s]: $*"; }
# step LOG CMD...: run quietly; on failure show the log's tail and stop.
step() {
    local log=$1
    shift
    if ! "$@" >"${log}" 2>&1; then
        tail -n 60 "${log}" >&2
        echo "wheel smoke: FAILED: $*" >&2
        exit 1
    fi
}

# Build from a copy of the tracked (and not ignored) files: no stale build/ of the tree gets in.
mkdir -p "${WORK}/src"
if git -C "${SRC}" rev-parse --git-dir >/dev/null 2>&1; then
    git -C "${SRC}" ls-files -z -c -o --exclude-standard \
        | tar -C "${SRC}" --null -T - --ignore-failed-read -cf - | tar -C "${WORK}/src" -xf -
else
    tar -C "${SRC}" --exclude=./.git --exclude=./.venv --exclude=./build -cf - . \
        | tar -C "${WORK}/src" -xf -
fi
"${PY}" -m pip wheel -q --no-deps "${WORK}/src" -w "${WORK}/dist"
WHEEL=$(ls "${WORK}"/dist/megatron_oases-*.whl)
say "built $(basename "${WHEEL}")"
"${PY}" - "${WHEEL}" <<'EOF'
import sys
import zipfile

names = set(zipfile.ZipFile(sys.argv[1]).namelist())
for need in ("clusters/rtx3090-pcie.yaml", "models/tiny-cpu.yaml", "compare_matrix.yaml"):
    if f"megatron_oases/configs/{need}" not in names:
        sys.exit(f"wheel smoke: the wheel has no megatron_oases/configs/{need}")
EOF

# torch and its requirements (closure, markers evaluated) from the CI venv, as symlinks in one
# directory that the fresh venv sees through a .pth file; everything else pip installs.
"${PY}" - "${WORK}/torch-site" <<'EOF'
import importlib.metadata as md
import os
import re
import sys

try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

out = sys.argv[1]
os.makedirs(out)
seen, todo, linked = set(), [("torch", "")], set()
while todo:  # (distribution, one of the extras asked of it)
    name, extra = todo.pop()
    name = re.sub(r"[-_.]+", "-", name).lower()
    if (name, extra) in seen:
        continue
    seen.add((name, extra))
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    for req in map(Requirement, dist.requires or []):
        if req.marker is None or req.marker.evaluate({"extra": extra}):
            todo += [(req.name, e) for e in ("", *req.extras)]
    root = dist.locate_file("")
    for f in dist.files or []:
        top = f.parts[0]
        if top in ("..", "__pycache__") or top in linked or top.endswith(".pth"):
            continue
        linked.add(top)
        os.symlink(os.path.join(root, top), os.path.join(out, top))
print(f"borrowed {len({n for n, _ in seen})} distributions (torch and its requirements)")
EOF
VENV="${WORK}/venv"
"${PY}" -m venv "${VENV}"
SITE=$("${VENV}/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
echo "${WORK}/torch-site" > "${SITE}/oases-smoke-torch.pth"
"${VENV}/bin/python" -m pip install -q "${WHEEL}"
say "installed into a fresh venv ($("${VENV}/bin/python" -m pip list 2>/dev/null | wc -l) packages)"

RUN="${WORK}/run"
mkdir -p "${RUN}"
cd "${RUN}"
export OMP_NUM_THREADS=1
"${VENV}/bin/python" - "${SRC}" <<'EOF'
import sys

import megatron_oases
from megatron_oases import resources

assert not megatron_oases.__file__.startswith(sys.argv[1]), megatron_oases.__file__
assert "rtx3090-pcie" in resources.available_clusters() and resources.model_config("tiny-cpu")
print(f"wheel smoke: megatron_oases from {megatron_oases.__file__}")
EOF
step compare-help.log "${VENV}/bin/oases" compare --help
say "oases compare --help: ok"
step profile.log "${VENV}/bin/oases" profile --analytic --cluster rtx3090-pcie --model h2048-l24 \
    --out profile.json
step plan.log "${VENV}/bin/oases" plan --profile profile.json --global-batch-size 16 --memory 24 \
    --schedule oases --solver ilp --verify --out plan.json
say "oases profile --analytic --cluster rtx3090-pcie --model h2048-l24, oases plan --solver ilp: ok"
# A fixed dilation: no host calibration in CI (what is checked is that the profile is found).
OASES_EMULATE_DILATION=10 step train.log "${VENV}/bin/python" -m torch.distributed.run \
    --nproc_per_node 2 --master_port "$((20000 + $$ % 20000))" "${VENV}/bin/oases" train \
    --tensor-model-parallel-size 2 --train-iters 3 --emulate-link rtx3090-pcie \
    --oases-schedule oases --recompute-granularity full --recompute-method uniform \
    --recompute-num-layers 1 --log-json golden.json </dev/null
"${VENV}/bin/python" -c "import json; v = json.load(open('golden.json'))['lm loss']['values']; \
assert len(v) == 3, v; print('wheel smoke: lm loss', ' '.join(f'{x:.4f}' for x in v))"
say "2-rank oases train demo (TP=2, oases schedule, --emulate-link rtx3090-pcie): ok"
