#!/bin/bash
# GPT pretraining with Oases on SLURM, Megatron-LM style: one srun task per node, each running torchrun
# over that node's GPUS_PER_NODE ranks. Outside SLURM it runs torchrun once, locally (CPU demo, tests).
#
#   sbatch --nodes 4 launch_scripts/slurm_pretrain_gpt_oases.sh                     # from the repo root
#   MODEL=gpt-18.4b OASES_SCHEDULE=oases EXTRA_ARGS="--recompute-granularity full --bf16" \
#       sbatch --nodes 4 launch_scripts/slurm_pretrain_gpt_oases.sh
#
# Environment (upper case, all optional):
#   ENTRY            the program, each on Megatron-LM's own pretrain() loop with the --oases-* flags:
#                    oases-train (default): `python -m megatron_oases train`
#                    pretrain-gpt-oases: `oases-pretrain-gpt` (Megatron-LM's pretrain_gpt.py on the
#                                        megatron.training the megatron-core wheel ships; no checkout)
#                    pretrain-gpt: ${MEGATRON_LM_DIR}/pretrain_gpt.py of a Megatron-LM checkout (tag
#                                  core_v0.19.x) with patches/pretrain_gpt.oases.patch applied
#   MODEL            a packaged model config (megatron_oases/configs/models/<MODEL>.yaml) or a
#                    path (default tiny-cpu)
#   TP, PP, MICRO_BATCH_SIZE, GLOBAL_BATCH_SIZE   override the model config
#   TRAIN_ITERS (100), LR (1.0e-4), OASES_SCHEDULE (off|overlap|cross-pass|oases), LOG_JSON (path)
#   EXTRA_ARGS       more flags, space-separated, appended last (they win over earlier ones)
#   GPUS_PER_NODE    ranks per node (default 8 with GPUs, 2 on CPU); NUM_NODES (the allocation's)
#   DEVICE           auto|cuda|cpu (cpu => --distributed-backend gloo; ENTRY=pretrain-gpt also gets
#                    the other flags a CPU run needs, which the oases entries add by themselves)
#   MASTER_ADDR, MASTER_PORT (default 20000 + SLURM_JOB_ID % 20000), DIST_TIMEOUT_MINUTES (10),
#   OMP_NUM_THREADS (1), PYTHON (python3), OASES_ROOT (repo root)
#   DRY_RUN=1        print the command line and exit
# Every value is checked before its use and never evaluated (launch_scripts/env_checks.sh); a bad
# one is one line and exit status 2.
#
#SBATCH --job-name=oases-pretrain-gpt
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=01:00:00
#SBATCH --output=slurm-%x-%j.out

set -euo pipefail

# Under sbatch this file runs from a spool copy: find the repo from the submit directory.
OASES_ROOT=${OASES_ROOT:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
if [[ ! -d "${OASES_ROOT}/megatron_oases/configs/models" ]]; then
    printf 'error: OASES_ROOT=%q has no megatron_oases/configs/models; submit from the %s\n' \
        "${OASES_ROOT}" "megatron-oases checkout or set OASES_ROOT" >&2
    exit 2
fi
PYTHON=${PYTHON:-python3}
export PYTHONPATH="${OASES_ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
cfg() { "${PYTHON}" -m megatron_oases.megatron_lm "$@"; }
# Every value from the environment is checked before its use, never evaluated; a bad one is one
# line and exit 2 before anything runs (not a bash or Python traceback later, nor its code run).
source "${OASES_ROOT}/launch_scripts/env_checks.sh"
DRY_RUN=${DRY_RUN:-0}
one_of DRY_RUN "${DRY_RUN}" 0 1

# ------------------------------------------------------------------------------------- runtime
DEVICE=${DEVICE:-auto}
one_of DEVICE "${DEVICE}" auto cuda cpu
if [[ "${DEVICE}" == auto ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        DEVICE=cuda
    else
        DEVICE=cpu
    fi
fi
# CUDA_DEVICE_MAX_CONNECTIONS: the entry points apply Megatron's rule where it is unset (1, or
# unset under --use-torch-fsdp2 / --use-megatron-fsdp: docs/megatron-lm.md).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
positive_int OMP_NUM_THREADS "${OMP_NUM_THREADS}"
if [[ "${DEVICE}" == cuda ]]; then
    GPUS_PER_NODE=${GPUS_PER_NODE:-8}
else
    GPUS_PER_NODE=${GPUS_PER_NODE:-2}
fi
NUM_NODES=${NUM_NODES:-${SLURM_JOB_NUM_NODES:-1}}
positive_int GPUS_PER_NODE "${GPUS_PER_NODE}"
positive_int NUM_NODES "${NUM_NODES}"
if [[ -z "${MASTER_ADDR:-}" ]]; then
    if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then
        MASTER_ADDR=$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)
    else
        MASTER_ADDR=127.0.0.1
    fi
fi
host MASTER_ADDR "${MASTER_ADDR}"
master_port
WORLD_SIZE=$((GPUS_PER_NODE * NUM_NODES))
DIST_TIMEOUT_MINUTES=${DIST_TIMEOUT_MINUTES:-10}
positive_int DIST_TIMEOUT_MINUTES "${DIST_TIMEOUT_MINUTES}"

# ------------------------------------------------------------------------------------- program
ENTRY=${ENTRY:-oases-train}
MODEL=${MODEL:-tiny-cpu}
case "${ENTRY}" in
    oases-train)
        PROGRAM=(-m megatron_oases train)
        PLATFORM_ARGS=()  # it adds what this host needs (megatron_oases.arguments.with_defaults)
        ;;
    pretrain-gpt-oases)
        OASES_PRETRAIN_GPT="$(dirname "$(command -v "${PYTHON}")")/oases-pretrain-gpt"
        if [[ ! -x "${OASES_PRETRAIN_GPT}" ]]; then
            OASES_PRETRAIN_GPT=$(command -v oases-pretrain-gpt) || {
                echo "error: ENTRY=pretrain-gpt-oases: oases-pretrain-gpt is not installed next to" \
                    "${PYTHON} nor on PATH (pip install megatron-oases)" >&2
                exit 2
            }
        fi
        PROGRAM=("${OASES_PRETRAIN_GPT}")
        PLATFORM_ARGS=()
        ;;
    pretrain-gpt)
        if [[ -z "${MEGATRON_LM_DIR:-}" ]]; then
            echo "error: ENTRY=pretrain-gpt needs MEGATRON_LM_DIR: a Megatron-LM checkout (tag" \
                "core_v0.19.x) with patches/pretrain_gpt.oases.patch applied" >&2
            exit 2
        fi
        if [[ ! -f "${MEGATRON_LM_DIR}/pretrain_gpt.py" ]]; then
            bad "MEGATRON_LM_DIR=$(shown "${MEGATRON_LM_DIR}") has no pretrain_gpt.py"
        fi
        export PYTHONPATH="${MEGATRON_LM_DIR}:${PYTHONPATH}"
        PROGRAM=("${MEGATRON_LM_DIR}/pretrain_gpt.py")
        # A patched pretrain_gpt.py takes Megatron-LM's flags as given: spell out our defaults.
        DEFAULTS_FOR=()
        [[ "${DEVICE}" == cpu ]] && DEFAULTS_FOR=(--cpu)
        read -r -a PLATFORM_ARGS <<< "$(cfg defaults "${DEFAULTS_FOR[@]}")"
        ;;
    *)
        bad "ENTRY=$(shown "${ENTRY}"): choose oases-train, pretrain-gpt-oases or pretrain-gpt"
        ;;
esac
DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer)

TP=${TP:-$(cfg get "${MODEL}" parallel.tensor-model-parallel-size 1)}
PP=${PP:-$(cfg get "${MODEL}" parallel.pipeline-model-parallel-size 1)}
positive_int TP "${TP}"
positive_int PP "${PP}"
if ((WORLD_SIZE % (TP * PP))); then
    bad "GPUS_PER_NODE x NUM_NODES = ${WORLD_SIZE} ranks is not a multiple of TP x PP =" \
        "$((TP * PP)); change GPUS_PER_NODE, TP or PP"
fi
MICRO_BATCH_SIZE=${MICRO_BATCH_SIZE:-$(cfg get "${MODEL}" training.micro-batch-size 2)}
positive_int MICRO_BATCH_SIZE "${MICRO_BATCH_SIZE}"
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-$(cfg get "${MODEL}" training.global-batch-size \
    $((MICRO_BATCH_SIZE * WORLD_SIZE / (TP * PP))))}
TRAIN_ITERS=${TRAIN_ITERS:-100}
LR=${LR:-1.0e-4}
positive_int GLOBAL_BATCH_SIZE "${GLOBAL_BATCH_SIZE}"
positive_int TRAIN_ITERS "${TRAIN_ITERS}"
[[ "${LR}" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] ||
    bad "LR=$(shown "${LR}"): must be a number, e.g. LR=1.0e-4"
OASES_SCHEDULE=${OASES_SCHEDULE:-off}
LOG_JSON=${LOG_JSON:-${OASES_ROOT}/out/${SLURM_JOB_NAME:-oases}-${SLURM_JOB_ID:-local}.json}
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

DISTRIBUTED_ARGS=(
    --nproc_per_node "${GPUS_PER_NODE}"
    --nnodes "${NUM_NODES}"
    --master_addr "${MASTER_ADDR}"
    --master_port "${MASTER_PORT}"
)
read -r -a GPT_MODEL_ARGS <<< "$(cfg flags "${MODEL}" --section model)"
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP}"
    --pipeline-model-parallel-size "${PP}"
    --transformer-impl local
    --distributed-timeout-minutes "${DIST_TIMEOUT_MINUTES}"
)
if [[ "${DEVICE}" == cpu ]]; then
    MODEL_PARALLEL_ARGS+=(--distributed-backend gloo)
fi
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH_SIZE}"
    --global-batch-size "${GLOBAL_BATCH_SIZE}"
    --train-iters "${TRAIN_ITERS}"
    --lr "${LR}"
    --min-lr "$("${PYTHON}" -c 'import sys; print(float(sys.argv[1]) / 10)' "${LR}")"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --init-method-std 0.02
)
OASES_ARGS=(--oases-schedule "${OASES_SCHEDULE}")
LOGGING_ARGS=(--log-interval 1 --log-json "${LOG_JSON}")

CMD=(
    "${PROGRAM[@]}"
    "${GPT_MODEL_ARGS[@]}"
    "${MODEL_PARALLEL_ARGS[@]}"
    "${TRAINING_ARGS[@]}"
    "${DATA_ARGS[@]}"
    "${OASES_ARGS[@]}"
    "${LOGGING_ARGS[@]}"
    "${PLATFORM_ARGS[@]}"
    "${EXTRA[@]}"
)

echo "oases launch: entry=${ENTRY} model=${MODEL} device=${DEVICE} nodes=${NUM_NODES}" \
    "ranks/node=${GPUS_PER_NODE} world=${WORLD_SIZE} TP=${TP} PP=${PP} schedule=${OASES_SCHEDULE}" \
    "master=${MASTER_ADDR}:${MASTER_PORT} json=${LOG_JSON}"
printf -v CMD_LINE '%q ' "${CMD[@]}"
echo "oases launch: ${CMD_LINE% }"
if [[ "${DRY_RUN}" == 1 ]]; then
    exit 0
fi
mkdir -p "$(dirname "${LOG_JSON}")"

if [[ -n "${SLURM_JOB_ID:-}" ]]; then
    # One task per node; torchrun there gets its node rank from SLURM. --kill-on-bad-exit ends every
    # node's torchrun when one fails (torchrun itself stops its other ranks when one of them dies).
    srun --nodes="${NUM_NODES}" --ntasks-per-node=1 --kill-on-bad-exit=1 --input=none \
        bash -c 'exec "$0" -m torch.distributed.run --node_rank "${SLURM_NODEID}" "$@"' \
        "${PYTHON}" "${DISTRIBUTED_ARGS[@]}" "${CMD[@]}"
else
    "${PYTHON}" -m torch.distributed.run --node_rank 0 "${DISTRIBUTED_ARGS[@]}" "${CMD[@]}" </dev/null
fi
