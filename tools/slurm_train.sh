#!/usr/bin/env bash
# Train on a Slurm cluster: one task per GPU, every task runs `memfit train --launcher slurm`.
#
#   GPUS=16 GPUS_PER_NODE=8 tools/slurm_train.sh PARTITION JOB_NAME CONFIG [memfit train args...]
#
# memfit reads SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID and takes MASTER_ADDR from the first node
# of the allocation (scontrol show hostnames); set MASTER_PORT to avoid clashes between jobs.
set -euo pipefail

if [ $# -lt 3 ]; then
    echo "usage: GPUS=N GPUS_PER_NODE=M $0 PARTITION JOB_NAME CONFIG [memfit train args...]" >&2
    exit 2
fi
PARTITION=$1
JOB_NAME=$2
CONFIG=$3
shift 3
GPUS=${GPUS:-8}
GPUS_PER_NODE=${GPUS_PER_NODE:-$(( GPUS < 8 ? GPUS : 8 ))}
CPUS_PER_TASK=${CPUS_PER_TASK:-5}
SRUN_ARGS=${SRUN_ARGS:-}
export MASTER_PORT=${MASTER_PORT:-$(( 20000 + RANDOM % 20000 ))}

# shellcheck disable=SC2086  # SRUN_ARGS is a list of extra srun options
srun -p "${PARTITION}" \
    --job-name="${JOB_NAME}" \
    --gres="gpu:${GPUS_PER_NODE}" \
    --ntasks="${GPUS}" \
    --ntasks-per-node="${GPUS_PER_NODE}" \
    --cpus-per-task="${CPUS_PER_TASK}" \
    --kill-on-bad-exit=1 \
    ${SRUN_ARGS} \
    python -u -m memfit train "${CONFIG}" --launcher slurm "$@"
