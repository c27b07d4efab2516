#!/usr/bin/env bash
# Multi node: run on every node with NNODES and MASTER_ADDR (and MASTER_PORT) set. The agents
# meet through torchrun's c10d rendezvous at MASTER_ADDR:MASTER_PORT under RUN_ID (the same on
# every node); node ranks are assigned by the rendezvous. MAX_RESTARTS > 0 restarts the whole
# group after a failure (every node), and with SAVE set the run resumes from its checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR}"
# A job's own id: restarts of this job share it (and take over its --save lock); another job
# must not (Slurm: the job id).
: "${RUN_ID:?set RUN_ID to an id unique to this job (the same on every node)}"
NPROC=${NPROC:-$(python -c 'import torch; print(torch.cuda.device_count() or 1)')}
exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "$RUN_ID" \
  --max-restarts "${MAX_RESTARTS:-0}" pretrain_agent_rl.py "${TRAIN_ARGS[@]}"
