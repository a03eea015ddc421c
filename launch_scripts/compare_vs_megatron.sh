#!/bin/bash
# Stock Megatron vs Oases variants × TP/PP layouts in ONE allocation: every run of a matrix from
# megatron_oases/configs/compare_matrix.yaml goes through slurm_pretrain_gpt_oases.sh (one srun step
# each), writes one golden-values JSON, and the job ends with one summary table (markdown) on stdout
# and in ${OUT_DIR}/summary.md. Outside SLURM the same loop runs locally (CPU demo).
#
#   sbatch --nodes 4 launch_scripts/compare_vs_megatron.sh                       # default matrix
#   MATRIX=paper-h4096-l16 sbatch --nodes 4 launch_scripts/compare_vs_megatron.sh
#
# Environment (all optional): MATRIX (name in the file; default: the file's `default`), MATRIX_FILE,
# OUT_DIR, TRAIN_ITERS, GPUS_PER_NODE (default: the matrix's gpus-per-node), ENTRY, DEVICE,
# EXTRA_ARGS (appended to every run), MASTER_PORT (base; run i uses base + i), PYTHON, OASES_ROOT.
# Exit status: 0 when every run succeeded, 1 otherwise (the table is written either way); 2 for a
# bad value (one line, before anything runs; every value is checked, never evaluated:
# launch_scripts/env_checks.sh).
#
#SBATCH --job-name=oases-compare
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out

set -uo pipefail  # no -e: one failed run must not stop the others

OASES_ROOT=${OASES_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
if [[ ! -d "${OASES_ROOT}/megatron_oases/configs/models" ]]; then
    printf 'error: OASES_ROOT=%q has no megatron_oases/configs/models; submit from the %s\n' \
        "${OASES_ROOT}" "megatron-oases checkout or set OASES_ROOT" >&2
    exit 2
fi
export OASES_ROOT
PYTHON=${PYTHON:-python3}
export PYTHON PYTHONPATH="${OASES_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
cfg() { "${PYTHON}" -m megatron_oases.megatron_lm "$@"; }
# The values this script reads from the environment, checked before anything runs (never
# evaluated); the launcher checks the rest of each run's.
source "${OASES_ROOT}/launch_scripts/env_checks.sh"
master_port
BASE_PORT=${MASTER_PORT}
[[ -n "${TRAIN_ITERS:-}" ]] && positive_int TRAIN_ITERS "${TRAIN_ITERS}"
[[ -n "${GPUS_PER_NODE:-}" ]] && positive_int GPUS_PER_NODE "${GPUS_PER_NODE}"

LAUNCHER=${LAUNCHER:-${OASES_ROOT}/launch_scripts/slurm_pretrain_gpt_oases.sh}
MATRIX_FILE=${MATRIX_FILE:-${OASES_ROOT}/megatron_oases/configs/compare_matrix.yaml}
MATRIX=${MATRIX:-}
MODEL=$(cfg matrix "${MATRIX_FILE}" "${MATRIX}" --field model) || exit 2
MATRIX_NAME=$(cfg matrix "${MATRIX_FILE}" "${MATRIX}" --field name) || exit 2
BASELINE=$(cfg matrix "${MATRIX_FILE}" "${MATRIX}" --field baseline --default "")
TRAIN_ITERS=${TRAIN_ITERS:-$(cfg matrix "${MATRIX_FILE}" "${MATRIX}" --field train-iters --default 20)}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(cfg matrix "${MATRIX_FILE}" "${MATRIX}" --field gpus-per-node \
    --default 8)}
RUN_LINES=$(cfg matrix "${MATRIX_FILE}" "${MATRIX}") || exit 2
RUNS=$(grep -c . <<< "${RUN_LINES}")
if ((BASE_PORT + RUNS - 1 > 65535)); then
    bad "MASTER_PORT=${BASE_PORT}: its ${RUNS} runs use ports ${BASE_PORT} to" \
        "$((BASE_PORT + RUNS - 1)), past 65535; choose a lower MASTER_PORT"
fi
OUT_DIR=${OUT_DIR:-${OASES_ROOT}/out/compare-${MATRIX_NAME}-${SLURM_JOB_ID:-local}}
mkdir -p "${OUT_DIR}"
RUNS_TSV="${OUT_DIR}/runs.tsv"
: > "${RUNS_TSV}"

echo "oases compare: matrix=${MATRIX_NAME} model=${MODEL} iters=${TRAIN_ITERS}" \
    "ranks/node=${GPUS_PER_NODE} out=${OUT_DIR}"
FAILED=0
INDEX=0
# fd 3: srun and torchrun must not eat the run list from stdin.
while IFS=$'\t' read -r -u 3 NAME RUN_TP RUN_PP SCHEDULE RUN_ARGS; do
    [[ -z "${NAME}" ]] && continue
    JSON="${OUT_DIR}/${NAME}.json"
    LOG="${OUT_DIR}/${NAME}.log"
    rm -f "${JSON}"
    START=$(date +%s)
    MODEL="${MODEL}" TP="${RUN_TP}" PP="${RUN_PP}" OASES_SCHEDULE="${SCHEDULE}" \
        TRAIN_ITERS="${TRAIN_ITERS}" GPUS_PER_NODE="${GPUS_PER_NODE}" LOG_JSON="${JSON}" \
        MASTER_PORT=$((BASE_PORT + INDEX)) EXTRA_ARGS="${RUN_ARGS} ${EXTRA_ARGS:-}" \
        bash "${LAUNCHER}" > "${LOG}" 2>&1 < /dev/null
    RC=$?
    if [[ ${RC} -eq 0 ]]; then
        STATUS=ok
    else
        STATUS="failed(${RC})"
        FAILED=$((FAILED + 1))
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "${NAME}" "${RUN_TP}" "${RUN_PP}" "${SCHEDULE}" "${STATUS}" \
        "${JSON}" >> "${RUNS_TSV}"
    echo "oases compare: ${NAME}: ${STATUS} in $(($(date +%s) - START)) s (log ${LOG})"
    INDEX=$((INDEX + 1))
done 3<<< "${RUN_LINES}"

cfg summary "${RUNS_TSV}" ${BASELINE:+--baseline "${BASELINE}"} | tee "${OUT_DIR}/summary.md"
if [[ ${PIPESTATUS[0]} -ne 0 ]]; then
    echo "oases compare: could not write the summary" >&2
    exit 1
fi
if [[ ${FAILED} -ne 0 ]]; then
    echo "oases compare: ${FAILED} of ${INDEX} runs failed" >&2
    exit 1
fi
echo "oases compare: ${INDEX} runs ok; summary ${OUT_DIR}/summary.md"
