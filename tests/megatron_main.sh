#!/usr/bin/env bash
# The suite against a Megatron-LM checkout (main, the next release's development branch) instead
# of the installed megatron-core wheel: the checkout goes first on PYTHONPATH, the rest of the
# environment is this one's. Usage: tests/megatron_main.sh CHECKOUT [pytest args...]
# (default: the unit tier). Prints the checkout's commit and megatron-core version first.
set -euo pipefail
checkout=$(cd "${1:?usage: tests/megatron_main.sh CHECKOUT [pytest args]}" && pwd)
shift
cd "$(dirname "$0")/.."
[ -f "${checkout}/megatron/core/package_info.py" ] || { echo "not a Megatron-LM checkout: ${checkout}" >&2; exit 2; }
commit=$(git -C "${checkout}" rev-parse --short HEAD 2>/dev/null || cat "${checkout}/.commit" 2>/dev/null || echo unknown)
export PYTHONPATH="${checkout}:${PWD}:${PYTHONPATH:-}" OASES_CHECK_MEGATRON_MAIN=1
PY=${PYTHON:-python}
"${PY}" - <<PYEOF
import warnings; warnings.filterwarnings("ignore")
import megatron.core
print(f"megatron-core {megatron.core.__version__} from ${checkout} (commit ${commit})")
PYEOF
exec "${PY}" -m pytest "${@:-tests/unit}"
