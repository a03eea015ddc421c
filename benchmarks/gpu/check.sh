#!/usr/bin/env bash
# The GPU check (benchmarks/gpu/check.py): on a machine with a CUDA GPU, one command of a few
# minutes that writes benchmarks/results/gpu/<date>-<gpu>/report.md (or --out DIR). --dry-run runs
# the same steps on the CPU with tiny shapes (CI does). Wheels carried in .whl/ (fetch_wheels.sh)
# are installed first when megatron-core is missing (the device tool's machine has none).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! "${PY}" -c "import megatron.core" 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        "${PY}" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/oases-site .whl/*.whl || exit 1
        export PYTHONPATH="/tmp/oases-site:${PYTHONPATH:-}"
    else
        echo "check.sh: megatron-core is not installed; run benchmarks/gpu/fetch_wheels.sh and carry .whl" >&2
        exit 2
    fi
fi
export PYTHONPATH="${PWD}:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 CUDA_DEVICE_MAX_CONNECTIONS=1
export PYTHONWARNINGS=ignore
exec "${PY}" benchmarks/gpu/check.py "$@"
