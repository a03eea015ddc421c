#!/bin/bash
# Local CPU demo, no SLURM and no GPU: 2 gloo ranks train the tiny model (packaged model config
# megatron_oases/configs/models/tiny-cpu.yaml) with `oases train`, TP=2, through the same launcher
# the SLURM jobs use, and print the golden values.
#
#   bash launch_scripts/run_cpu_demo.sh
#   OASES_SCHEDULE=oases EXTRA_ARGS="--recompute-granularity full --recompute-method uniform \
#       --recompute-num-layers 1" bash launch_scripts/run_cpu_demo.sh
#   bash launch_scripts/compare_vs_megatron.sh     # the whole cpu-demo matrix, also without SLURM
#   DRY_RUN=1 bash launch_scripts/run_cpu_demo.sh   # the command line only
# Every value from the environment is checked before its use, never evaluated (the launcher's
# checks, launch_scripts/env_checks.sh); a bad one is one line and exit status 2.
set -euo pipefail
OASES_ROOT=${OASES_ROOT:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if [[ ! -f "${OASES_ROOT}/launch_scripts/env_checks.sh" ]]; then
    printf 'error: OASES_ROOT=%q has no launch_scripts/env_checks.sh; run the demo from the %s\n' \
        "${OASES_ROOT}" "megatron-oases checkout or set OASES_ROOT" >&2
    exit 2
fi
source "${OASES_ROOT}/launch_scripts/env_checks.sh"
PYTHON=${PYTHON:-python3}
export OASES_ROOT PYTHON
export DEVICE=cpu ENTRY=oases-train
export MODEL=${MODEL:-tiny-cpu} GPUS_PER_NODE=${GPUS_PER_NODE:-2} TRAIN_ITERS=${TRAIN_ITERS:-10}
positive_int GPUS_PER_NODE "${GPUS_PER_NODE}"
positive_int TRAIN_ITERS "${TRAIN_ITERS}"
export DRY_RUN=${DRY_RUN:-0}
one_of DRY_RUN "${DRY_RUN}" 0 1
export OASES_SCHEDULE=${OASES_SCHEDULE:-off}
export LOG_JSON=${LOG_JSON:-${OASES_ROOT}/out/cpu-demo-${OASES_SCHEDULE}.json}
# Not inside a SLURM allocation even when called from one: run torchrun locally.
unset SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_JOB_NUM_NODES
bash "${OASES_ROOT}/launch_scripts/slurm_pretrain_gpt_oases.sh"
[[ "${DRY_RUN}" == 1 ]] && exit 0
echo "cpu demo: golden values in ${LOG_JSON}"
"${PYTHON}" -c "import json, sys; d = json.load(open(sys.argv[1])); \
print('lm loss:', ' '.join(f'{v:.4f}' for v in d['lm loss']['values']))" "${LOG_JSON}"
